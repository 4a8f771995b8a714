"""kill -9 of the runner of the reference pipeline, in each kind of stage in turn: the thread-pool
ingest, the Dask preprocess, xgboost.dask training beside torch DDP training on the same
workers (killed once as each starts), the stacked model, the evaluation. After each kill: no
process of the run is left, every out is whole (the previous version or the new one), the
next command records the run as interrupted, and the next run does not redo what succeeded.
Each run goes one stage further than the last, so the whole series costs about one pipeline
run plus start-ups. The ingest reads its file from a local HTTP server that holds the first run's
transfers until that run is killed: a kill in the thread pool, whatever the machine's load.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sklearn
from httpfiles import FlakyServer
from projects import Project

pytestmark = pytest.mark.slow

KILL_IN = ["ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate"]
SOURCE = "file://{package:sklearn}/datasets/data/breast_cancer.csv"


@pytest.fixture
def held_source() -> Iterator[FlakyServer]:
    """The reference's CSV over HTTP, each GET held until ``held`` is set."""
    csv = (Path(sklearn.__file__).parent / "datasets/data/breast_cancer.csv").read_bytes()
    held = threading.Event()
    source = FlakyServer({"breast_cancer.csv": csv}, held=held)
    server = source.start()
    try:
        yield source
    finally:
        held.set()
        server.shutdown()
        server.server_close()


def wait_until_running(project: Project, stage: str, proc: subprocess.Popen[str], timeout_s: float = 300) -> str:
    """The run id once ``stage`` of the current run has started (its events file says so)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended before {stage} started"
        latest = project.root / ".conveyor/runs/latest.json"
        if latest.exists():
            run_id = json.loads(latest.read_text())["run_id"]
            events = project.root / f".conveyor/runs/{run_id}.events"
            if events.exists() and any(json.loads(line)["stage"] == stage and json.loads(line)["status"] == "running"
                                       for line in events.read_text().splitlines() if line.strip()):
                return str(run_id)
        time.sleep(0.05)
    raise AssertionError(f"{stage} never started")


def assert_outs_whole(root: Path) -> None:
    """Every out there is readable: parquet parts, JSON models and metrics, the torch model;
    no temporary or partial file is left in the project's own folders."""
    for part in (root / "data").rglob("*.parquet"):
        pq.read_metadata(part)
    for path in [*(root / "metrics").glob("*.json"), *(root / "models").glob("*.json")]:
        json.loads(path.read_text())
    if (root / "models/mlp.pt").exists():
        assert zipfile.is_zipfile(root / "models/mlp.pt")
    for folder in ("data", "models", "metrics", "plots"):
        leftovers = [p for p in (root / folder).rglob(".*")] if (root / folder).exists() else []
        assert leftovers == [], leftovers


def test_kill_9_in_each_kind_of_stage_loses_nothing_and_the_next_run_resumes(
        reference_project: Project, held_source: FlakyServer) -> None:
    project = reference_project
    params = project.root / "params.yaml"
    assert SOURCE in params.read_text()
    # the same bytes, over HTTP, held until the first run is killed
    params.write_text(params.read_text().replace(SOURCE, held_source.url("breast_cancer.csv")))
    held = held_source.held
    assert held is not None
    spec = project.root / "configs/pipeline.yaml"
    on_workers = spec.read_text().replace(" in_process_below: 64MiB,", "")
    assert "in_process_below" not in on_workers  # the 569 rows would run in process: the kills must land in Dask
    ddp = "    task: tasks.train:mlp_model\n"
    pinned = re.search(r"\n    deterministic: true[^\n]*", on_workers[on_workers.index(ddp):])
    assert ddp in on_workers and pinned is not None
    # torch DDP, one rank per worker, beside xgboost.dask (a deterministic task runs in a process of its own)
    on_workers = on_workers.replace(ddp + pinned.group(0).lstrip("\n") + "\n", ddp + "    on: cpu\n")
    assert "    on: cpu\n" in on_workers
    spec.write_text(on_workers)
    succeeded: set[str] = set()
    interrupted: set[str] = set()
    killed_in: set[str] = set()
    for stage in KILL_IN:
        if stage in succeeded:  # the last kill landed after this quick stage had finished
            continue
        proc = project.popen("run")
        run_id = wait_until_running(project, stage, proc)
        killed_in.add(stage)
        if stage == "ingest":  # its transfers are held: the kill surely lands in the thread pool
            assert held_source.asked.wait(300), "the ingest asked for no block"
        else:
            time.sleep(0.1)  # into its work (a quick stage may end first: then the kill lands between stages)
        proc.kill()
        proc.communicate(timeout=30)
        held.set()  # the runs after this one fetch at once
        assert not project.left_running(grace_s=5), f"a process outlived the run killed in {stage}"

        status = project.conveyor("status")
        assert status.returncode == 0, status.stderr
        assert f"the last run ({run_id}) was killed" in status.stderr
        killed = json.loads((project.root / f".conveyor/runs/{run_id}.json").read_text())
        assert killed["status"] == "interrupted", killed
        stages = {name: st["status"] for name, st in killed["stages"].items()}
        assert stages[stage] in ("interrupted", "succeeded"), stages
        assert all(stages[done] == "skipped" for done in succeeded), (stage, stages)  # nothing redone
        assert set(stages.values()) <= {"skipped", "succeeded", "interrupted", "not_run"}, stages
        succeeded |= {name for name, st in stages.items() if st == "succeeded"}
        interrupted |= {name for name, st in stages.items() if st == "interrupted"}
        assert_outs_whole(project.root)
        assert not list((project.root / ".conveyor/journal").glob("*")), "an outs journal entry was left"

    # the long stages were surely mid-work when killed: threads, Dask, xgboost.dask and torch
    assert {"ingest", "preprocess", "train_xgb", "train_mlp"} <= interrupted, interrupted
    final = project.conveyor("run")
    assert final.returncode == 0, final.stdout + final.stderr
    stages = {name: st["status"] for name, st in project.record()["stages"].items()}
    skipped = {name for name, st in stages.items() if st == "skipped"}
    # nothing that finished is redone; a quick stage may also have recorded its outs (dvc.lock) in the instant
    # between its work and its end event when the kill landed: interrupted in the record, rightly skipped now
    assert succeeded <= skipped and skipped - succeeded <= killed_in, (skipped, succeeded, killed_in)
    assert {name for name, st in stages.items() if st == "succeeded"} == set(stages) - skipped
    assert json.loads((project.root / "metrics/test.json").read_text())["stack"]["auc"] >= 0.97
    assert_outs_whole(project.root)
    assert not project.left_running()
