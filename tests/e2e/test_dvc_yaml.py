"""An existing dvc.yaml run as it is (SPEC.md §2.3): the real `dvc` CLI on twin copies.

A DVC project written for these tests, with every dvc.yaml key conveyor reads through
DVC (vars, ${}, a params file other than params.yaml, foreach, matrix, wdir, frozen,
always_changed, cache: false, persist, metrics, plots, desc, meta)::

    download (frozen) ──► prepare ──► train@{0.1,0.3}-{small,big} ──► report@{summary,detail} (wdir)
                                                                 └──► curve (plots)
    log (always_changed, persist, cache: false)

One copy runs under `conveyor run`, its twin under `dvc repro`: afterwards the outs,
dvc.lock and .gitignore files are the same, and DVC finds nothing to do in either.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import yaml
from projects import Project
from repos import ANALYTICS_OFF, git_dvc_init

DVC_YAML = """
vars:
  - params.yaml
  - config.yaml
  - greeting: hello
stages:
  download:
    cmd: exit 1
    frozen: true
    outs:
      - data/raw.txt
  prepare:
    desc: keep the first lines
    meta: {owner: tests}
    cmd: head -n ${prepare.lines} data/raw.txt > data/prepared.txt
    deps:
      - data/raw.txt
    params:
      - prepare.lines
    outs:
      - data/prepared.txt
  train:
    matrix:
      lr: [0.1, 0.3]
      size: [small, big]
    cmd: python train.py ${item.lr} ${item.size} ${greeting} ${train.epochs}
    deps:
      - data/prepared.txt
      - train.py
    params:
      - train.epochs
      - config.yaml:
          - model.depth
    outs:
      - models/${item.size}-${item.lr}.txt
    metrics:
      - metrics/${item.size}-${item.lr}.json:
          cache: false
  report:
    foreach: [summary, detail]
    do:
      wdir: reports
      cmd: cat ../models/small-0.1.txt ../models/big-0.1.txt ../models/small-0.3.txt ../models/big-0.3.txt > ${item}.txt
      deps:
        - ../models/small-0.1.txt
        - ../models/big-0.1.txt
        - ../models/small-0.3.txt
        - ../models/big-0.3.txt
      outs:
        - ${item}.txt
  log:
    always_changed: true
    cmd: echo ran >> runs.txt
    outs:
      - runs.txt:
          persist: true
          cache: false
  curve:
    cmd: cat metrics/small-0.1.json metrics/big-0.3.json > curve.json
    deps:
      - metrics/small-0.1.json
      - metrics/big-0.3.json
    plots:
      - curve.json
"""

TRAIN = """
import json, sys, time
from pathlib import Path

lr, size, greeting, epochs = sys.argv[1:]
time.sleep(1)  # long enough for the items of the matrix to be seen running at once
text = Path("data/prepared.txt").read_text()
Path("models").mkdir(exist_ok=True)
Path(f"models/{size}-{lr}.txt").write_text(f"{greeting} {size} {lr} {epochs} {len(text)}\\n")
Path("metrics").mkdir(exist_ok=True)
Path(f"metrics/{size}-{lr}.json").write_text(json.dumps({"score": float(lr) * int(epochs)}))
"""

TRAIN_ITEMS = {"train@0.1-small", "train@0.1-big", "train@0.3-small", "train@0.3-big"}
STAGES = {"download", "prepare", *TRAIN_ITEMS, "report@summary", "report@detail", "log", "curve"}
OUTS = ["data/prepared.txt", "models/small-0.1.txt", "models/big-0.3.txt", "metrics/big-0.3.json",
        "reports/summary.txt", "reports/detail.txt", "curve.json", "runs.txt",
        ".gitignore", "data/.gitignore", "reports/.gitignore"]


def dvc_repo(make_project: Callable[[], Project], dvc_yaml: str = DVC_YAML) -> Project:
    """A plain DVC project (no pyproject.toml, no conveyor spec): git, DVC, a hand-written dvc.yaml."""
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", dvc_yaml)
    project.write("params.yaml", "prepare: {lines: 3}\ntrain: {epochs: 2}\n")
    project.write("config.yaml", "model: {depth: 4}\n")
    project.write("train.py", TRAIN)
    project.write("data/raw.txt", "l1\nl2\nl3\nl4\n")  # the frozen stage's out, made by hand
    (project.root / "reports").mkdir()
    git_dvc_init(project.root, ANALYTICS_OFF)
    project.sh("git", "config", "user.email", "test@example.com")
    project.sh("git", "config", "user.name", "conveyor tests")
    project.write(".gitignore", "/.conveyor/\n")
    project.sh("git", "add", "dvc.yaml", "params.yaml", "config.yaml", "train.py", ".gitignore", ".dvc")
    project.sh("git", "commit", "-qm", "a DVC pipeline")
    return project


def twin(project: Project) -> Project:
    copy = project.root.with_name(project.root.name + "-twin")
    shutil.copytree(project.root, copy, symlinks=True)
    return Project(copy, project.env, project.tag)


def lock(project: Project) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((project.root / "dvc.lock").read_text())
    return data


def ran_by_dvc(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def ran_by_conveyor(project: Project) -> set[str]:
    return {name for name, st in project.record()["stages"].items() if st["status"] == "succeeded"}


def dvc_status(project: Project) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(project.sh("dvc", "status", "--json").stdout)
    return data


def assert_same_workspace(ours: Project, theirs: Project) -> None:
    for rel in OUTS:
        mine, dvcs = (ours.root / rel).read_bytes(), (theirs.root / rel).read_bytes()
        if rel.endswith(".gitignore"):  # DVC appends a line per out as each finishes: order aside
            mine, dvcs = b"".join(sorted(mine.splitlines(True))), b"".join(sorted(dvcs.splitlines(True)))
        assert mine == dvcs, rel
    # the same entries; YAML key order may differ: stages finishing at once are written as they finish
    assert lock(ours) == lock(theirs)


@pytest.mark.slow
def test_a_dvc_yaml_runs_as_it_is_and_dvc_agrees(make_project: Callable[[], Project]) -> None:
    ours = dvc_repo(make_project)
    theirs = twin(ours)

    run = ours.conveyor("run")
    assert run.returncode == 0, run.stderr
    repro = theirs.sh("dvc", "repro")
    assert ran_by_dvc(repro.stdout) == STAGES - {"download"}  # DVC only verifies a frozen stage
    record = ours.record()
    assert set(record["stages"]) == STAGES  # named as DVC names them
    assert ran_by_conveyor(ours) == STAGES
    assert_same_workspace(ours, theirs)
    assert (ours.root / ".dvc/cache/runs").is_dir()  # the run cache, as dvc repro keeps it

    # the items of the matrix ran at once (at least two: one per core)
    spans = sorted((datetime.fromisoformat(record["stages"][s]["started"]),
                    datetime.fromisoformat(record["stages"][s]["finished"])) for s in TRAIN_ITEMS)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans
    # metrics declared in dvc.yaml are in the record
    assert record["stages"]["train@0.3-big"]["metrics"] == {"score": 0.6}

    # DVC agrees: nothing changed but the stage that always changes
    assert dvc_status(ours) == {"log": ["always changed"]}
    again = ours.sh("dvc", "repro")
    assert ran_by_dvc(again.stdout) == {"log"}

    # a param of another params file: exactly the stages dvc repro reruns (the train items;
    # their outs come out the same, so the reports downstream do not run again)
    for project in (ours, theirs):
        project.write("config.yaml", "model: {depth: 5}\n")
    status = ours.conveyor("status")
    assert "params changed: model.depth 4 → 5" in status.stdout, status.stdout
    assert ours.conveyor("run").returncode == 0
    repro = theirs.sh("dvc", "repro")
    assert ran_by_conveyor(ours) == ran_by_dvc(repro.stdout) == TRAIN_ITEMS | {"log"}
    assert {s: st["status"] for s, st in ours.record()["stages"].items()}["report@summary"] == "skipped"

    # a param that changes what the items write: the reports downstream run as well
    for project in (ours, theirs):
        project.write("params.yaml", "prepare: {lines: 3}\ntrain: {epochs: 3}\n")
    assert ours.conveyor("run").returncode == 0
    repro = theirs.sh("dvc", "repro")
    expected = TRAIN_ITEMS | {"report@summary", "report@detail", "curve", "log"}
    assert ran_by_conveyor(ours) == ran_by_dvc(repro.stdout) == expected
    assert dvc_status(ours) == {"log": ["always changed"]}
    assert lock(ours)["stages"]["train@0.1-small"] == lock(theirs)["stages"]["train@0.1-small"]
    assert ours.left_running() == []


FAILING = """
stages:
  base:
    cmd: echo base > base.txt
    outs: [base.txt]
  good:
    cmd: cat base.txt > good.txt && sleep 1
    deps: [base.txt]
    outs: [good.txt]
  bad:
    cmd: echo half > bad.txt && echo 'no luck' >&2 && exit 3
    deps: [base.txt]
    outs: [bad.txt]
  after:
    cmd: cat bad.txt > after.txt
    deps: [bad.txt]
    outs: [after.txt]
"""


@pytest.mark.slow
def test_a_failing_stage_leaves_the_lock_entries_of_the_stages_that_finished(
        make_project: Callable[[], Project]) -> None:
    project = dvc_repo(make_project, FAILING)
    run = project.conveyor("run")
    assert run.returncode == 1
    assert "no luck" in run.stdout and "resume with: conveyor run bad --downstream" in run.stdout
    statuses = {n: s["status"] for n, s in project.record()["stages"].items()}
    assert statuses == {"base": "succeeded", "good": "succeeded", "bad": "failed", "after": "not_run"}
    assert set(lock(project)["stages"]) == {"base", "good"}  # as dvc repro --keep-going leaves it
    assert not (project.root / "bad.txt").exists()  # a failed stage's outs are not left half-written
    assert set(dvc_status(project)) == {"bad", "after"}


PLACED = """
stages:
  fit:
    foreach: [a, b]
    do:
      cmd: "test -f tried-${item} || { touch tried-${item}; exit 1; }; echo ${item} > fit-${item}.txt"
      outs:
        - fit-${item}.txt
  slow:
    cmd: sleep 30 && echo late > slow.txt
    outs: [slow.txt]
"""


@pytest.mark.slow
def test_placement_adds_profiles_retries_and_timeouts_without_touching_dvc_yaml(
        make_project: Callable[[], Project]) -> None:
    project = dvc_repo(make_project, PLACED)
    project.write("configs/placed.yaml", """
        dvc: dvc.yaml
        profiles:
          io: {kind: threads, max_workers: 2}
        placement:
          "*": {timeout_s: 60}
          "fit@*": {on: io, retries: 1}
          slow: {timeout_s: 1}
        """)
    before = (project.root / "dvc.yaml").read_bytes()
    planned = project.conveyor("run", "fit", "--dry-run", "-c", "configs/placed.yaml")  # a group: its items
    assert planned.returncode == 0, planned.stderr
    assert "fit@a" in planned.stdout and "fit@b" in planned.stdout and "slow" not in planned.stdout
    run = project.conveyor("run", "-c", "configs/placed.yaml")
    assert run.returncode == 1, run.stderr
    stages = project.record()["stages"]
    assert {n: (s["status"], s["profile"], s["attempts"]) for n, s in stages.items() if n.startswith("fit")} == {
        "fit@a": ("succeeded", "io", 2), "fit@b": ("succeeded", "io", 2)}
    assert stages["slow"]["status"] == "failed" and "timed out after 1s" in stages["slow"]["error"]
    assert (project.root / "dvc.yaml").read_bytes() == before
    assert set(lock(project)["stages"]) == {"fit@a", "fit@b"}


def test_a_bad_dvc_yaml_is_exit_2_with_file_line_and_key(make_project: Callable[[], Project]) -> None:
    """The CLI's side of the cases in tests/spec/test_dvc_yaml.py: one line each, exit 2, no traceback."""
    project = make_project()
    project.write("dvc.yaml", "stages:\n  a:\n    cmd: echo ${nope}\n")
    git_dvc_init(project.root)
    done = project.conveyor("run")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dvc.yaml:3 stages.a.cmd: Could not find 'nope'" in done.stderr
    assert "Traceback" not in done.stderr


def test_compile_has_nothing_to_do_for_a_dvc_yaml(make_project: Callable[[], Project]) -> None:
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", "stages:\n  a:\n    cmd: echo hi > a.txt\n    outs: [a.txt]\n")
    git_dvc_init(project.root)
    before = (project.root / "dvc.yaml").read_bytes()
    done = project.conveyor("compile")
    assert done.returncode == 2 and "runs dvc.yaml as it is: there is nothing to compile" in done.stderr
    assert (project.root / "dvc.yaml").read_bytes() == before
    (project.root / "src").mkdir()  # from a folder inside the project, as from its root
    status = subprocess.run(["conveyor", "status"], cwd=project.root / "src", env=project.env, capture_output=True,
                            text=True, timeout=300)
    assert status.returncode == 0 and "never run" in status.stdout, status.stderr
