"""conveyor and DVC as one pipeline: the real `dvc` CLI in temporary git repos.

The pipeline used here::

    a ──► b ──► c        b reads params b.n; c writes metrics/score.json
    └───► d              d is an independent branch
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from projects import REPO, Project
from repos import dvc, dvc_here

TASKS = '''
import json, time
from pathlib import Path


def write(ctx):
    for path in [*ctx.outs.values(), *ctx.metrics.values()]:
        path.write_text(json.dumps({"stage": ctx.stage, "params": dict(ctx.params)}, sort_keys=True))


def score(ctx):
    n = json.loads(Path(ctx.dep("out/b.json")).read_text())["params"]["b"]["n"]
    ctx.out("out/c.json").write_text(json.dumps({"n": n}))
    ctx.out("metrics/score.json").write_text(json.dumps({"score": n * 2}))


def hold(ctx):
    """Announce the stage runs, then hold (the run and its locks) until the test releases it."""
    (ctx.root / "hold.started").write_text("1")
    deadline = time.monotonic() + 120
    while not (ctx.root / "hold.release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    write(ctx)
'''


def git(project: Project, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=project.root, capture_output=True, text=True, check=True)
    return done.stdout


def dvc_project(make_project: Callable[[], Project], d_task: str = "write") -> Project:
    """A git + DVC repo holding the pipeline above, compiled and committed."""
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", "a: {n: 1}\nb: {n: 2}\n")
    project.write("configs/pipeline.yaml", f"""
        pipeline: dvc-demo
        profiles:
          io: {{kind: threads, max_workers: 2}}
        stages:
          a: {{task: tasks.steps:write, on: io, params: [a], outs: [out/a.json]}}
          b: {{task: tasks.steps:write, params: [b], deps: [out/a.json], outs: [out/b.json]}}
          c: {{task: tasks.steps:score, deps: [out/b.json], outs: [out/c.json], metrics: [metrics/score.json]}}
          d: {{task: tasks.steps:{d_task}, deps: [out/a.json], outs: [out/d]}}
        """)
    project.write(".gitignore", "/.conveyor/\n__pycache__/\nhold.*\n")
    git(project, "init", "-q")
    git(project, "config", "user.email", "test@example.com")
    git(project, "config", "user.name", "conveyor tests")
    project.sh("dvc", "init", "-q")
    project.sh("dvc", "config", "core.analytics", "false")
    assert project.conveyor("compile").returncode == 0
    git(project, "add", "-A")
    git(project, "commit", "-qm", "pipeline")
    return project


def stale_in_dvc_status(project: Project) -> set[str]:
    done = project.sh("dvc", "status", "--json")
    return set(json.loads(done.stdout))


def statuses(project: Project) -> dict[str, str]:
    return {n: s["status"] for n, s in project.record()["stages"].items()}


def conveyor_status(project: Project) -> dict[str, str]:
    """`conveyor status` as {stage: why}; '' for up to date."""
    done = project.conveyor("status")
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 3 and cells[0] in {"a", "b", "c", "d"}:
            rows[cells[0]] = cells[2]
    return rows


@pytest.mark.slow
def test_compile_and_check_drift(make_project: Callable[[], Project]) -> None:
    project = dvc_project(make_project)
    compiled = yaml.safe_load((project.root / "dvc.yaml").read_text())["stages"]
    assert compiled["b"] == {"cmd": "conveyor exec b", "deps": ["out/a.json", "tasks/steps.py"],
                             "params": ["b"], "outs": ["out/b.json"]}
    assert compiled["c"]["metrics"] == [{"metrics/score.json": {"cache": False}}]
    assert project.conveyor("compile", "--check").returncode == 0

    spec = project.root / "configs/pipeline.yaml"
    spec.write_text(spec.read_text().replace("params: [b]", "params: [b, a]"))
    check = project.conveyor("compile", "--check")
    assert check.returncode == 1
    assert "+    - a" in check.stdout and "dvc.yaml is out of date" in check.stderr
    # the dvc.yaml is conveyor's: a question reads it as compiled anew and writes nothing, a run compiles it
    written = (project.root / "dvc.yaml").read_text()
    assert project.conveyor("status").returncode == 0
    assert (project.root / "dvc.yaml").read_text() == written
    run = project.conveyor("run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dvc.yaml compiled again from configs/pipeline.yaml and its params (commit it with dvc.lock)" in run.stderr
    assert project.conveyor("compile", "--check").returncode == 0


@pytest.mark.slow
def test_one_fingerprint_for_conveyor_run_and_dvc_repro(make_project: Callable[[], Project]) -> None:
    project = dvc_project(make_project)
    assert project.conveyor("run").returncode == 0
    assert set(statuses(project).values()) == {"succeeded"}
    assert stale_in_dvc_status(project) == set()
    assert set(yaml.safe_load((project.root / "dvc.lock").read_text())["stages"]) == {"a", "b", "c", "d"}

    # One param read by one stage: DVC names that stage; conveyor names it and what follows.
    project.write("params.yaml", "a: {n: 1}\nb: {n: 5}\n")
    assert stale_in_dvc_status(project) == {"b"}
    assert conveyor_status(project) == {"a": "", "b": "params changed: b.n 2 → 5",
                                        "c": "upstream 'b' is stale", "d": ""}

    repro = project.sh("dvc", "repro")
    assert "Running stage 'b'" in repro.stdout and "Running stage 'a'" not in repro.stdout
    assert project.conveyor("run").returncode == 0
    assert set(statuses(project).values()) == {"skipped"}
    assert json.loads((project.root / "metrics/score.json").read_text()) == {"score": 10}


@pytest.mark.slow
def test_dvc_repro_first_then_conveyor_skips(make_project: Callable[[], Project]) -> None:
    project = dvc_project(make_project)
    project.sh("dvc", "repro")
    assert stale_in_dvc_status(project) == set()
    run = project.conveyor("run")
    assert run.returncode == 0
    assert set(statuses(project).values()) == {"skipped"}
    assert run.stdout.count("up to date") >= 4


@pytest.mark.slow
def test_a_run_and_dvc_repro_never_run_at_once(make_project: Callable[[], Project]) -> None:
    project = dvc_project(make_project, d_task="hold")
    first = project.popen("run")
    started = project.root / "hold.started"
    deadline = time.monotonic() + 120
    while not started.exists():  # stage d announces that the run is under way
        assert first.poll() is None, first.stdout.read() if first.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    repro = project.sh("dvc", "repro", check=False)
    assert repro.returncode != 0 and "Unable to acquire lock" in repro.stderr
    second = project.conveyor("run")
    assert second.returncode == 1
    assert "another conveyor run holds" in second.stderr
    assert time.monotonic() - t0 < 60  # both refused at once, neither waited for the run
    (project.root / "hold.release").write_text("1")
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    assert stale_in_dvc_status(project) == set()  # dvc.lock intact and complete

    # The other way round: while `dvc repro` holds the repository, conveyor refuses at once.
    started.unlink()
    (project.root / "hold.release").unlink()
    project.write("params.yaml", "a: {n: 2}\nb: {n: 2}\n")
    repro_proc = subprocess.Popen(["dvc", "repro"], cwd=project.root, env=project.env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert repro_proc.poll() is None, repro_proc.stdout.read() if repro_proc.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    last = project.record()["run_id"]
    refused = project.conveyor("run")
    assert refused.returncode == 1
    assert "DVC is running in" in refused.stderr and "dvc repro" in refused.stderr
    assert project.record()["run_id"] == last  # refused before anything started: no run, no record
    (project.root / "hold.release").write_text("1")
    out, _ = repro_proc.communicate(timeout=120)
    assert repro_proc.returncode == 0, out
    assert stale_in_dvc_status(project) == set()


@pytest.mark.slow
def test_dvc_experiments_on_the_compiled_pipeline(make_project: Callable[[], Project]) -> None:
    project = dvc_project(make_project)
    assert project.conveyor("run").returncode == 0
    git(project, "add", "-A")
    git(project, "commit", "-qm", "baseline")
    exp = project.sh("dvc", "exp", "run", "-S", "b.n=7")
    assert "Running stage 'b'" in exp.stdout and "Running stage 'a'" not in exp.stdout
    assert json.loads((project.root / "metrics/score.json").read_text()) == {"score": 14}
    shown = json.loads(dvc_here(project.root, ["exp", "show", "--json"], project.env).stdout)  # `exp run`: a process
    assert shown  # the experiment is recorded against the baseline commit
    diff = project.sh("dvc", "metrics", "diff", "--json").stdout
    assert json.loads(diff)["metrics/score.json"]["score"] == {"old": 4, "new": 14, "diff": 10}


@pytest.mark.slow
def test_dvc_repro_on_a_fresh_clone_reproduces_the_committed_metrics(tmp_path: Path,
                                                                     prefect_server: dict[str, str]) -> None:
    """The repository's own reference pipeline: `dvc repro` on a clean clone, metrics as committed."""
    committed = subprocess.run(["git", "show", "HEAD:metrics/test.json"], cwd=REPO, capture_output=True, text=True)
    if committed.returncode != 0:
        pytest.skip("no metrics/test.json committed yet")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    done = subprocess.run(["dvc", "repro"], cwd=clone, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((clone / "metrics/test.json").read_text()) == json.loads(committed.stdout)
    shown = dvc(clone, "metrics", "show", "--json")
    assert shown.returncode == 0 and "metrics/test.json" in shown.stdout
    plots = dvc(clone, "plots", "show", "plots/roc.png", "-o", str(tmp_path / "plots"))
    assert plots.returncode == 0, plots.stderr
    page = (tmp_path / "plots" / "index.html").read_text()
    assert "roc.png" in page


CMD_SPEC = """
pipeline: dvc-cmd
stages:
  make:
    task: tasks.steps:write
    params: [a]
    outs: [out/a.json]
  scale:
    cmd:
      - python ../scripts/scale.py ../out/a.json scaled.txt ${b.n}
      - echo "scaled by ${b.n}"
    wdir: work
    deps: [out/a.json, scripts/scale.py]
    outs: [work/scaled.txt]
"""

SCALE = '''
import json, sys
from pathlib import Path
params = json.loads(Path(sys.argv[1]).read_text())["params"]
Path(sys.argv[2]).write_text(str(params["a"]["n"] * int(sys.argv[3])) + "\\n")
'''


@pytest.mark.slow
def test_a_cmd_stage_compiles_to_its_command_and_dvc_repro_runs_it_natively(
        make_project: Callable[[], Project]) -> None:
    """${b.n} stays for DVC to interpolate; paths become relative to wdir; after `dvc repro`
    conveyor has nothing to do, and a changed param reruns the command under either tool."""
    project = dvc_project(make_project)
    project.write("configs/pipeline.yaml", CMD_SPEC)
    project.write("scripts/scale.py", SCALE)
    project.write("work/.gitkeep", "")
    assert project.conveyor("compile").returncode == 0
    compiled = yaml.safe_load((project.root / "dvc.yaml").read_text())["stages"]["scale"]
    assert compiled == {"cmd": ["python ../scripts/scale.py ../out/a.json scaled.txt ${b.n}",
                                'echo "scaled by ${b.n}"'],
                        "wdir": "work", "deps": ["../out/a.json", "../scripts/scale.py"], "outs": ["scaled.txt"]}

    repro = project.sh("dvc", "repro")
    assert "scaled by 2" in repro.stdout  # DVC ran the command itself, interpolated
    assert (project.root / "work/scaled.txt").read_text() == "2\n"
    assert project.conveyor("run").returncode == 0
    assert set(statuses(project).values()) == {"skipped"}

    project.write("params.yaml", "a: {n: 1}\nb: {n: 7}\n")
    assert stale_in_dvc_status(project) == {"scale"}
    status = project.conveyor("status").stdout  # the command changed only by its ${b.n}: named as such, once
    assert status.count("params changed: b.n 2 → 7") == 1 and "command changed" not in status, status
    run = project.conveyor("run")
    assert run.returncode == 0, run.stderr
    assert statuses(project) == {"make": "skipped", "scale": "succeeded"}
    assert (project.root / "work/scaled.txt").read_text() == "7\n"
    assert stale_in_dvc_status(project) == set()


@pytest.mark.slow
def test_adding_dvc_to_a_project_that_ran_reruns_nothing(make_project: Callable[[], Project]) -> None:
    """conveyor's own record is carried into dvc.lock by `conveyor compile`."""
    project = make_project()
    project.write("params.yaml", "a: {n: 1}\n")
    project.write("configs/pipeline.yaml", """
        pipeline: later-dvc
        stages:
          a: {cmd: "mkdir -p out && echo ${a.n} > out/a.txt", params: [a], outs: [out/a.txt]}
          b: {cmd: "cp out/a.txt out/b.txt", deps: [out/a.txt], outs: [out/b.txt]}
          c: {cmd: "echo never > out/c.txt", outs: [out/c.txt]}
        """)
    assert project.conveyor("run", "b").returncode == 0  # a and b ran; c never did
    git(project, "init", "-q")
    project.sh("dvc", "init", "-q")
    project.sh("dvc", "config", "core.analytics", "false")
    compiled = project.conveyor("compile")
    assert compiled.returncode == 0, compiled.stderr
    assert "recorded 2 up-to-date stage(s) in dvc.lock and the DVC cache, so they do not rerun: a, b" \
        in compiled.stdout
    assert stale_in_dvc_status(project) == {"c"}
    status = conveyor_status(project)
    assert status == {"a": "", "b": "", "c": "never run"}
    again = project.conveyor("run")
    assert again.returncode == 0, again.stderr
    assert statuses(project) == {"a": "skipped", "b": "skipped", "c": "succeeded"}
    assert "Updating lock file" not in again.stdout + again.stderr  # DVC's line is in c's log
    assert "Updating lock file 'dvc.lock'" in project.conveyor("logs", "c").stdout
    assert project.conveyor("compile").stdout.count("recorded") == 0  # DVC's record is the one now


IMPORTED = """
md5: 0123456789abcdef0123456789abcdef
frozen: true
deps:
- path: data.txt
  repo:
    url: /nonexistent/registry
    rev_lock: f59388cd04276e75d70b2136597aaa27e7937cc3
outs:
- md5: 0123456789abcdef0123456789abcdef
  size: 4
  hash: md5
  path: data.txt
"""


def test_an_import_whose_repository_cannot_be_reached_fails_the_run_in_dvcs_words(
        make_project: Callable[[], Project], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dvc import`ed data that changed is verified against the repository it came from (DVC's example
    project's data.xml, offline): that repository gone, the run stops in one line, as `dvc repro` does."""
    project = make_project()
    project.init_dvc()
    # DVC leaves the empty temporary folder of the clone that failed (tmpXXXXdvc-clone): in the test's own
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # `dvc repro` runs in this process
    project.env["TMPDIR"] = str(scratch)
    project.write("data.txt", "new\n")
    project.write("data.txt.dvc", IMPORTED)
    project.write("dvc.yaml", "stages:\n  copy: {cmd: cp data.txt out.txt, deps: [data.txt], outs: [out.txt]}\n")
    said = "failed to reproduce 'data.txt.dvc': SCM error: Failed to clone repo '/nonexistent/registry'"
    repro = project.sh("dvc", "repro", check=False)
    assert repro.returncode != 0 and said in repro.stderr, repro.stderr
    run = project.conveyor("run")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and run.stderr.strip().splitlines()[-1].startswith(said), run.stderr
    assert not (project.root / "out.txt").exists()
