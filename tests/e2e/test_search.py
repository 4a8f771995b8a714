"""`conveyor search`: trials on the stage's profile, recorded, ranked, reproducible with `run -S`.

The project is the one `conveyor init` makes (its ridge regression, `train`, on its 2-worker
`cpu` profile); the real CLI in subprocesses, the session's Prefect server for `conveyor run`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from projects import Project

SEARCH = ("search", "train", "--param", "train.alpha=loguniform(1e-4,10)",
          "--param", "train.test_fraction=uniform(0.1,0.4)", "--objective", "metrics/train.json:rmse",
          "--minimize", "--seed", "7")
TRIALS = 8


def init_project(tmp_path: Path, prefect_server: dict[str, str]) -> Project:
    """`conveyor init`'s project, with `train` on its 2-worker `cpu` profile, run once."""
    env = {**os.environ, **prefect_server, "COLUMNS": "200"}
    made = subprocess.run(["conveyor", "init", "proj"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    project = Project(tmp_path / "proj", env, "")
    spec = project.root / "configs/pipeline.yaml"
    text = spec.read_text()
    assert "    deterministic: true              # the command runs" in text
    spec.write_text(text.replace("    deterministic: true              # the command runs",
                                 "    on: cpu\n    deterministic: true              # the command runs", 1))
    for args in (("compile",), ("run",)):
        done = project.conveyor(*args)
        assert done.returncode == 0, done.stdout + done.stderr
    return project


def most_at_once(stages: dict[str, Any]) -> tuple[int, float]:
    """The most trials that ran at the same moment, and the share of the search's span when 2 did."""
    edges = sorted([(datetime.fromisoformat(s["started"]), 1) for s in stages.values()] +
                   [(datetime.fromisoformat(s["finished"]), -1) for s in stages.values()],
                   key=lambda e: (e[0], e[1]))
    running, most, both = 0, 0, 0.0
    for (when, step), (after, _) in itertools.pairwise(edges):
        running += step
        most = max(most, running)
        both += (after - when).total_seconds() if running >= 2 else 0.0
    span = (edges[-1][0] - edges[0][0]).total_seconds()
    return most, both / span


@pytest.mark.slow
def test_a_search_beats_the_params_file_on_both_workers_and_every_trial_reproduces_with_its_command(
        tmp_path: Path, prefect_server: dict[str, str]) -> None:
    project = init_project(tmp_path, prefect_server)
    params, model = (project.root / "params.yaml").read_text(), (project.root / "models/model.json").read_bytes()
    default = json.loads((project.root / "metrics/train.json").read_text())["rmse"]

    # 8 trials: 4 rounds on the 2 workers, each trial then run again by its command (a run each)
    t0 = time.monotonic()
    done = project.conveyor(*SEARCH, "--trials", str(TRIALS))
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    record = project.record()
    trials = record["stages"]
    assert sorted(trials) == sorted(f"train@trial-{n}" for n in range(TRIALS)), sorted(trials)
    assert {s["status"] for s in trials.values()} == {"succeeded"}
    assert trials["train@trial-0"]["item"] == {"train.alpha": 1.0, "train.test_fraction": 0.2}  # the params file's
    assert trials["train@trial-0"]["metrics"]["rmse"] == default
    best = min(s["metrics"]["rmse"] for s in trials.values())
    assert best < default, (best, default)
    assert record["search"]["best"] in trials and trials[record["search"]["best"]]["metrics"]["rmse"] == best

    # both workers busy, never more than the profile's 2
    most, both = most_at_once(trials)
    print(f"{TRIALS} trials in {took:.1f}s (wall {record['wall_s']}s, trials' sum {record['stage_sum_s']}s, "
          f"overlap {record['speedup']}x, 2 at once {both:.0%} of the time)")
    assert most == 2 and both > 0.6 and record["speedup"] > 1.3, (most, both, record["speedup"])

    # the project is untouched: its params, its model, its record with DVC
    assert (project.root / "params.yaml").read_text() == params
    assert (project.root / "models/model.json").read_bytes() == model
    assert "Data and pipelines are up to date" in project.sh("dvc", "status").stdout

    # every trial, ranked in the summary with its command, reproduces its metric in the project
    lines = re.findall(r"^\s+(\d+)\s+(train@trial-\d+)\s+rmse (\S+)\s+(conveyor run .*)$", done.stdout, re.M)
    assert [int(rank) for rank, *_ in lines] == list(range(1, TRIALS + 1)), done.stdout
    assert [float(v) for _, _, v, _ in lines] == sorted(float(v) for _, _, v, _ in lines)
    for _, name, _, command in lines:
        again = project.conveyor(*command.split()[1:])
        assert again.returncode == 0, again.stdout + again.stderr
        assert json.loads((project.root / "metrics/train.json").read_text())["rmse"] == \
            trials[name]["metrics"]["rmse"], name

    # compare ranks the trials by the objective
    compared = project.conveyor("compare", record["run_id"]).stdout
    order = re.findall(r"(train@trial-\d+)", compared)
    assert order == [name for _, name, _, _ in lines], compared


STEP = '''
import json, os, sys, time
x, model, metrics = float(sys.argv[1]), sys.argv[2], sys.argv[3]
marks = "marks"
open(os.path.join(marks, f"started-{os.getpid()}"), "w").close()
ended = [m for m in os.listdir(marks) if m.startswith("ended")]
if not os.path.exists(os.path.join(marks, "fast")) and len(ended) >= 2:
    time.sleep(120)  # held: the test interrupts the search now
os.makedirs(os.path.dirname(model), exist_ok=True)
os.makedirs(os.path.dirname(metrics), exist_ok=True)
open(model, "w").write(str(x))
json.dump({"loss": (x - 0.3) ** 2}, open(metrics, "w"))
open(os.path.join(marks, f"ended-{os.getpid()}"), "w").close()
'''

SPEC = '''
pipeline: held
profiles:
  pool: {kind: threads, max_workers: 2}
stages:
  fit:
    cmd: python step.py ${fit.x} models/m.txt metrics/fit.json
    on: pool
    deps: [step.py]
    params: [fit]
    outs: [models/m.txt]
    metrics: [metrics/fit.json]
'''


def marks(project: Project, prefix: str) -> int:
    return sum(1 for m in (project.root / "marks").iterdir() if m.name.startswith(prefix))


ARGS = ("search", "fit", "--param", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:loss",
        "--trials", "6", "--seed", "3")


def held_search(make_project: Callable[[], Project]) -> tuple[Project, subprocess.Popen[str]]:
    """A search of 6 trials whose first 2 end and the next 2 are held, in a process group of its own."""
    project = make_project()
    project.write("configs/pipeline.yaml", SPEC)
    project.write("params.yaml", "fit:\n  x: 0.5\n")
    project.write("step.py", STEP)
    (project.root / "marks").mkdir()
    proc = subprocess.Popen(["conveyor", *ARGS], cwd=project.root, env=project.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (marks(project, "ended") == 2 and marks(project, "started") == 4):  # 2 done, 2 held
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the trials never started"
        time.sleep(0.05)
    return project, proc


@pytest.mark.slow
def test_ctrl_c_stops_a_search_and_the_same_command_continues_it_to_its_trials(
        make_project: Callable[[], Project]) -> None:
    project, proc = held_search(make_project)
    args = ARGS
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    screen = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, screen
    assert "Traceback" not in screen, screen
    assert re.search(r"interrupted \(SIGINT\): stopped fit@trial-\d, fit@trial-\d \(recorded interrupted\); "
                     r"2 of 6 trials done: the same command continues the search", screen), screen
    assert not project.left_running(grace_s=10), "a trial outlived the interrupted search"
    first = project.record()
    assert first["status"] == "interrupted"
    assert sorted(s["status"] for s in first["stages"].values()) == ["interrupted"] * 2 + ["succeeded"] * 2
    assert not (project.root / "models").exists() and (project.root / "params.yaml").read_text() == "fit:\n  x: 0.5\n"

    (project.root / "marks/fast").touch()
    again = project.conveyor(*args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "search fit: 6 trial(s) of study" in again.stdout and "(4 this run)" in again.stdout, again.stdout
    ranked = re.findall(r"^\s+\d+\s+(fit@trial-\d+)\s+loss", again.stdout, re.M)
    interrupted = {n for n, s in first["stages"].items() if s["status"] == "interrupted"}
    assert len(ranked) == 6 and not interrupted & set(ranked), again.stdout  # none lost, none twice
    assert set(ranked) >= {n for n, s in first["stages"].items() if s["status"] == "succeeded"}
    assert len(project.record()["stages"]) == 4
    again_id = project.record()["run_id"]

    done = project.conveyor(*args)  # the study has its 6: nothing more runs
    assert done.returncode == 0 and "(0 this run)" in done.stdout, done.stdout + done.stderr
    assert project.record()["run_id"] == again_id


@pytest.mark.slow
def test_a_killed_search_is_settled_by_the_next_one_which_continues_it(make_project: Callable[[], Project]) -> None:
    project, proc = held_search(make_project)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the held trials' commands too
    proc.communicate(timeout=60)
    killed = project.record()
    assert killed["status"] == "running" and killed["stages"] == {}  # its trials are in its events file

    (project.root / "marks/fast").touch()
    again = project.conveyor(*ARGS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"the last run ({killed['run_id']}) was killed" in again.stderr, again.stderr
    settled = json.loads((project.root / f".conveyor/runs/{killed['run_id']}.json").read_text())
    assert settled["status"] == "interrupted"
    assert sorted(s["status"] for s in settled["stages"].values()) == ["succeeded"] * 2, settled["stages"]
    assert "search fit: 6 trial(s) of study" in again.stdout and "(4 this run)" in again.stdout, again.stdout
    ranked = set(re.findall(r"^\s+\d+\s+(fit@trial-\d+)\s+loss", again.stdout, re.M))
    assert len(ranked) == 6 and ranked >= set(settled["stages"]), again.stdout
