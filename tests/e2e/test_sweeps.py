"""Sweeps end to end: a 2×2 matrix of task stages on a Dask profile and of cmd stages, run at
once; a stage that needs the matrix sees every item; ``-S`` reruns what reads the key; and
``conveyor compile`` hands ``dvc repro`` the same matrix.

    train@0.1-2 ┐
    train@0.1-4 ├──► pick      (task items on the dask profile; pick needs: [train])
    train@0.3-2 │
    train@0.3-4 ┘
    sweep@a-1 … sweep@b-2      (cmd items on the same profile's workers)
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import yaml
from projects import Project

TASKS = '''
import json, threading, time

# the items meet here: the run gets past it only when two of them run at the same time
RENDEZVOUS = threading.Barrier(2, timeout=60)


def score(eta, depth, rounds):
    return round(eta * depth * rounds, 6)


def train(ctx):
    RENDEZVOUS.wait()
    # the work itself runs on a Dask worker of the stage's profile
    value = ctx.client.submit(score, ctx.item["eta"], ctx.item["depth"], ctx.params["train.rounds"]).result()
    ctx.metric().write_text(json.dumps({"score": value}))
    ctx.out().write_text(json.dumps(ctx.item))


def pick(ctx):
    scores = {p.name: json.loads(p.read_text())["score"] for p in sorted((ctx.root / "metrics").glob("*.json"))}
    best = max(scores, key=scores.get)
    ctx.out().write_text(json.dumps({"seen": sorted(scores), "best": best}))
'''

# Each command item waits until another one has started: it passes only when two run at once.
MEET = ("touch runs/started-${key} && for i in $(seq 600); do "
        "[ $(ls runs | grep -c started-) -ge 2 ] && break; sleep 0.1; done && "
        "echo ${item.letter} ${item.n} > runs/${key}.txt")

SPEC = f"""
pipeline: sweep
profiles:
  cpu: {{kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}}
stages:
  train:
    task: tasks.steps:train
    on: cpu
    matrix:
      eta: [0.1, 0.3]
      depth: [2, 4]
    params: [train.rounds]
    outs:
      - models/m-${{item.eta}}-${{item.depth}}.json
    metrics:
      - metrics/m-${{key}}.json
  pick:
    task: tasks.steps:pick
    needs: [train]
    outs: [models/best.json]
  sweep:
    cmd: {MEET}
    on: cpu
    matrix:
      letter: [a, b]
      n: [1, 2]
    outs:
      - runs/${{key}}.txt
"""

TRAIN = ["train@0.1-2", "train@0.1-4", "train@0.3-2", "train@0.3-4"]
SWEEP = ["sweep@a-1", "sweep@a-2", "sweep@b-1", "sweep@b-2"]


def sweep_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", "train:\n  rounds: 10  # boosting rounds\n")
    project.write("configs/pipeline.yaml", SPEC)
    (project.root / "runs").mkdir()
    return project


def overlapping(stages: dict[str, Any], names: list[str]) -> bool:
    """Some two of ``names`` ran at the same time (one started before the other finished)."""
    spans = sorted((datetime.fromisoformat(stages[n]["started"]), datetime.fromisoformat(stages[n]["finished"]))
                   for n in names)
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


@pytest.mark.slow
def test_a_matrix_runs_its_items_at_once_and_reruns_what_an_override_changes(
        make_project: Callable[[], Project]) -> None:
    project = sweep_project(make_project)
    done = project.conveyor("run")
    assert done.returncode == 0, done.stdout + done.stderr
    record = project.record()
    stages = record["stages"]
    assert {n: s["status"] for n, s in stages.items()} == dict.fromkeys([*TRAIN, "pick", *SWEEP], "succeeded")
    assert overlapping(stages, TRAIN) and overlapping(stages, SWEEP)
    assert {n: stages[n]["profile"] for n in [*TRAIN, *SWEEP]} == dict.fromkeys([*TRAIN, *SWEEP], "cpu")
    assert stages["train@0.3-4"]["item"] == {"eta": 0.3, "depth": 4}
    assert stages["train@0.3-4"]["metrics"] == {"score": 12.0}
    assert record["params"] == {"train.rounds": 10} and record["overrides"] == {}
    # the stage that needs the matrix ran after every item, and saw them all
    assert json.loads((project.root / "models/best.json").read_text()) == {
        "seen": [f"m-{n.partition('@')[2]}.json" for n in TRAIN], "best": "m-0.3-4.json"}
    assert min(stages[n]["finished"] for n in TRAIN) <= max(stages[n]["finished"] for n in TRAIN) \
        <= stages["pick"]["started"]
    assert (project.root / "runs/b-2.txt").read_text() == "b 2\n"
    assert not project.left_running()
    first = record["run_id"]

    # -S sets the param in params.yaml as `dvc exp run -S` does: the items reading it rerun
    again = project.conveyor("run", "-S", "train.rounds=20")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "-S set params.yaml: train.rounds 10 → 20" in again.stderr
    record = project.record()
    assert record["overrides"] == {"train.rounds": 20} and record["params"] == {"train.rounds": 20}
    statuses = {n: s["status"] for n, s in record["stages"].items()}
    assert statuses == {**dict.fromkeys([*TRAIN, "pick"], "succeeded"), **dict.fromkeys(SWEEP, "skipped")}
    assert record["stages"]["train@0.1-2"]["reason"] == "params changed: train.rounds 10 → 20"
    assert record["stages"]["train@0.3-4"]["metrics"] == {"score": 24.0}
    assert (project.root / "params.yaml").read_text() == "train:\n  rounds: 20  # boosting rounds\n"

    # compare: each item's metric in both runs, a row per item, the value set with -S marked
    shown = project.conveyor("compare", first, record["run_id"], "--plot", "compare.html")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    item_rows = [line.split()[2:] for line in shown.stdout.splitlines() if "train@0.3-4" in line]
    assert item_rows == [["10", "0.3", "4", "12"], ["20*", "0.3", "4", "24"]], shown.stdout
    page = (project.root / "compare.html").read_text()
    assert "train:score" in page and first in page and "<svg" in page

    bad = project.conveyor("run", "-S", "train.round=5")
    assert bad.returncode == 2
    assert "params.yaml has no key 'train.round' (did you mean 'train.rounds'?)" in bad.stderr
    assert "Traceback" not in bad.stderr

    one = project.conveyor("run", "train@0.1-2", "--force", "--dry-run")  # an item by its DVC name
    assert one.returncode == 0, one.stderr
    assert "train@0.1-2" in one.stdout and "train@0.1-4" not in one.stdout


def git(project: Project, *args: str) -> None:
    subprocess.run(["git", *args], cwd=project.root, capture_output=True, text=True, check=True)


def dvc(project: Project, *args: str) -> str:
    done = subprocess.run(["dvc", *args], cwd=project.root, env=project.env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_compile_gives_dvc_repro_the_same_matrix(make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("params.yaml", "fit: {rounds: 3}\nsizes: [10, 20]\n")
    project.write("configs/pipeline.yaml", """
        pipeline: sweep
        stages:
          fit:
            cmd: echo ${item.size} ${item.kind} ${fit.rounds} > out/${key}.txt
            matrix:
              size: ${sizes}
              kind: [lin, tree]
            params: [fit.rounds]
            outs:
              - out/${key}.txt
          report:
            cmd: cat out/*.txt > report.txt
            needs: [fit]
            outs: [report.txt]
        """)
    (project.root / "out").mkdir()
    project.write(".gitignore", "/.conveyor/\n")
    git(project, "init", "-q")
    git(project, "config", "user.email", "test@example.com")
    git(project, "config", "user.name", "conveyor tests")
    dvc(project, "init", "-q")
    compiled = project.conveyor("compile")
    assert compiled.returncode == 0, compiled.stderr
    written = yaml.safe_load((project.root / "dvc.yaml").read_text())["stages"]
    assert written["fit"]["matrix"] == {"size": "${sizes}", "kind": ["lin", "tree"]}
    git(project, "add", "-A")
    git(project, "commit", "-qm", "sweep")

    dvc(project, "repro")  # DVC expands the same items, one after another
    assert sorted(p.name for p in (project.root / "out").glob("*.txt")) == [
        "10-lin.txt", "10-tree.txt", "20-lin.txt", "20-tree.txt"]
    status = project.conveyor("status")
    assert status.returncode == 0 and "stale" not in status.stdout, status.stdout

    # conveyor runs them at once, and DVC agrees afterwards
    forced = project.conveyor("run", "-S", "fit.rounds=4")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert {n: s["status"] for n, s in project.record()["stages"].items()} == {
        "fit@10-lin": "succeeded", "fit@10-tree": "succeeded", "fit@20-lin": "succeeded",
        "fit@20-tree": "succeeded", "report": "succeeded"}
    assert (project.root / "out/20-tree.txt").read_text() == "20 tree 4\n"
    assert "Data and pipelines are up to date" in dvc(project, "status")
    assert "Stage 'fit@10-lin' didn't change" in dvc(project, "repro")
