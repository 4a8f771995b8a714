"""`conveyor init`, as a new user runs it: a project outside this repository that runs green at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import jsonschema
import pytest
from docpages import commands
from kernels import KERNEL_PATHS
from repos import dvc

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_new_project_runs_skips_agrees_with_dvc_and_passes_its_own_tests(
        tmp_path: Path, prefect_server: dict[str, str]) -> None:
    assert not tmp_path.is_relative_to(REPO)
    env = {**os.environ, **prefect_server}
    # the commands of docs/getting-started/own-project.md, which its doc test leaves to this test
    page = (REPO / "docs/getting-started/own-project.md").read_text()
    assert [c.text.split("#")[0].strip() for c in commands(page)] == [
        "conveyor init myproj", "cd myproj", "conveyor run", "python -m pytest"], "run the page's new commands here"

    made = run(["conveyor", "init", "myproj"], tmp_path, env)
    assert made.returncode == 0, made.stderr
    assert "made the conveyor project myproj" in made.stdout and "cd myproj" in made.stdout
    root = tmp_path / "myproj"
    assert (root / ".git").is_dir() and (root / ".dvc").is_dir()
    assert run(["conveyor", "compile", "--check"], root, env).returncode == 0

    first = run(["conveyor", "run"], root, env)
    assert first.returncode == 0, first.stdout + first.stderr
    record = json.loads((root / ".conveyor/runs/latest.json").read_text())
    assert {n: s["status"] for n, s in record["stages"].items()} == {
        "make_data": "succeeded", "featurize": "succeeded", "train": "succeeded"}
    assert {n: s["profile"] for n, s in record["stages"].items()} == {
        "make_data": "io", "featurize": "cpu", "train": "local"}
    # 2,000 rows: under the cpu profile's in_process_below, no cluster is started for them
    assert record["stages"]["featurize"]["placement"].startswith("in process: its deps hold"), record
    assert json.loads((root / "metrics/train.json").read_text())["r2"] > 0.95
    assert "ridge alpha=1.0: test r2" in (root / f".conveyor/logs/{record['run_id']}/train.log").read_text()

    second = run(["conveyor", "run"], root, env)
    assert second.returncode == 0, second.stderr
    record = json.loads((root / ".conveyor/runs/latest.json").read_text())
    assert {s["status"] for s in record["stages"].values()} == {"skipped"}
    # a teammate's CPU: the same bytes under an AVX2-only and a baseline machine's kernel paths
    lock = (root / "dvc.lock").read_text()
    for name, kernels in KERNEL_PATHS.items():  # each its own environment, run once: cold, and no runner kept for it
        forced = run(["conveyor", "run", "--force"], root, {**env, **kernels, "CONVEYOR_WARM": "0"})
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert (root / "dvc.lock").read_text() == lock, name
    status = dvc(root, "status", env=env)
    assert status.returncode == 0 and "Data and pipelines are up to date." in status.stdout, \
        status.stdout + status.stderr

    # right after its first run, a new project serves its model (no champion yet: the latest run's)
    server = subprocess.Popen(["conveyor", "serve-model", "--port", "0"], cwd=root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "(latest run) at http://127.0.0.1:" in line, line
        model = json.loads((root / "models/model.json").read_text())
        scaler = json.loads((root / "models/scaler.json").read_text())
        row = dict.fromkeys(model["features"], 1.0)  # a raw row: the model standardises it as featurize did
        request = urllib.request.Request(line.split(" at ")[1].split()[0] + "/predict",
                                         json.dumps({"rows": [row]}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            scores = json.loads(answer.read())["scores"]
        expected = model["intercept"] + sum(coef * (1.0 - scaler["mean"][name]) / scaler["std"][name]
                                            for name, coef in zip(model["features"], model["coef"], strict=True))
        assert scores == pytest.approx([expected])
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 130

    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    # its types are checked with the other static checks, in .ci/run (a cold mypy: 16 CPU-s)


@pytest.mark.slow
def test_a_new_project_says_how_to_test_it_points_editors_at_the_schema_and_dvc_adds_its_own_data(
        tmp_path: Path) -> None:
    made = run(["conveyor", "init", "myproj"], tmp_path)
    assert made.returncode == 0, made.stderr
    assert 'pip install -e ".[test]"' in made.stdout  # before `python -m pytest`: a new project has no pytest
    root = tmp_path / "myproj"

    # the spec's first line names a schema file that is there, and is the installed conveyor's schema
    first = (root / "configs/pipeline.yaml").read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    schema_path = (root / "configs" / first.partition("$schema=")[2]).resolve()
    schema = json.loads(schema_path.read_text())
    assert schema == json.loads(run(["conveyor", "schema"], root).stdout)
    from conveyor.spec.yamlmap import load_yaml

    jsonschema.Draft202012Validator(schema).validate(load_yaml(root / "configs/pipeline.yaml").data)

    # git ignores the stage outs, not the project's own inputs beside them
    (root / "data").mkdir()
    (root / "data/my.csv").write_text("x,y\n1,2\n")
    added = dvc(root, "add", "data/my.csv")
    assert added.returncode == 0, added.stdout + added.stderr
    assert (root / "data/my.csv.dvc").is_file()
    outs = ["data/raw.csv", "data/features/part.0.parquet", "models/scaler.json", "models/model.json"]
    assert run(["git", "check-ignore", *outs], root).stdout.split() == outs


def test_init_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")

    done = run(["conveyor", "init", "taken"], tmp_path)

    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"{tmp_path / 'taken'} is not empty: conveyor init makes a project in a new "
                                   "or empty directory (pass another DIR)")
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]


def test_init_inside_a_git_repository_makes_a_dvc_subdirectory(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)

    done = run(["conveyor", "init", "pipelines/churn"], tmp_path)

    assert done.returncode == 0, done.stderr
    root = tmp_path / "pipelines" / "churn"
    assert not (root / ".git").exists()  # the repository it is in is its repository
    assert (root / ".dvc").is_dir() and not (tmp_path / ".dvc").exists()
    assert run(["dvc", "root"], root).stdout.strip() == "."
    assert run(["conveyor", "validate"], root).stdout.startswith("configs/pipeline.yaml: ok (3 stages, 2 profiles)")
    assert "pipeline: churn" in (root / "configs/pipeline.yaml").read_text()
    assert "a DVC subdir project of the git repository around it; commit it when you are ready" in done.stdout
    assert run(["git", "rev-list", "--all"], tmp_path).stdout == ""  # the user's repository: no commit made in it


def test_a_new_project_starts_with_its_first_commit_and_a_clean_tree(tmp_path: Path) -> None:
    done = run(["conveyor", "init", "fresh"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(git and DVC initialised, first commit made)" in done.stdout
    root = tmp_path / "fresh"
    assert len(run(["git", "rev-list", "--all"], root).stdout.split()) == 1
    assert run(["git", "status", "--porcelain"], root).stdout == ""  # everything init made is committed
    tracked = run(["git", "ls-files"], root).stdout.split()
    assert {"dvc.yaml", "configs/pipeline.yaml", ".dvc/config", ".gitignore"} <= set(tracked)


def test_without_a_git_identity_init_says_so_and_makes_no_commit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), GIT_CONFIG_NOSYSTEM="1",
               EMAIL="", GIT_CONFIG_GLOBAL=str(home / "gitconfig"))
    (home / "gitconfig").write_text("[user]\n\tuseConfigOnly = true\n")  # no guessing from the host name
    done = run(["conveyor", "init", "fresh"], tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert ("no first commit: git has no user.name and user.email here (git config --global user.name/"
            "user.email), then git commit") in done.stdout
    assert run(["git", "rev-list", "--all"], tmp_path / "fresh", env).stdout == ""


@pytest.mark.slow
def test_the_wheel_holds_only_the_conveyor_package(tmp_path: Path) -> None:
    # built from a copy of what the build reads: pip builds in the source tree, and there it wrote
    # build/ and src/conveyor.egg-info into the repository (an in-tree build/lib keeps the copy of a
    # module deleted since; a new entry in src/ also renamed the warm runner of every later test)
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)], tmp_path)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("conveyor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"conveyor", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "conveyor/py.typed" in names  # projects type-check against it
    assert {"conveyor/scaffold/template/tasks/data.py", "conveyor/scaffold/template/gitignore"} <= set(names)
    assert not any("__pycache__" in n for n in names)
