"""Stage logs, the output capture and the live view's progress text, without Prefect."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conveyor.errors import UsageError
from conveyor.run import capture
from conveyor.run.context import StageProgress
from conveyor.run.logs import StageLog, find_log, log_path, stage_logger
from conveyor.run.metrics import read_metrics, stage_metrics


@pytest.mark.parametrize(("total", "done", "unit", "shown"), [
    (12, 3, "files", "3/12 files"),
    (0.119889, 0.09022, "MB", "0.09/0.12 MB"),
    (1024.0, 512.5, "rows", "512/1,024 rows"),
    (None, 7, "epochs", "7 epochs"),
])
def test_progress_numbers_are_short(total: float | None, done: float, unit: str, shown: str) -> None:
    progress = StageProgress()
    progress.start(total, unit=unit)
    progress.advance(done)
    assert progress.render() == shown


def test_progress_falls_back_to_the_latest_log_line() -> None:
    progress = StageProgress()
    progress.note("epoch 3: loss 0.12")
    assert progress.render() == "epoch 3: loss 0.12"
    progress.description = "importing tasks.mlp"  # what the runner sets while a task imports
    assert progress.render() == "importing tasks.mlp"


def test_a_stage_log_holds_its_records_from_any_thread_and_nothing_of_other_stages(tmp_path: Path) -> None:
    seen: list[str] = []
    train, other = log_path(tmp_path, "r1", "train"), log_path(tmp_path, "r1", "other")
    with StageLog(train, "train", on_line=seen.append):
        log = stage_logger("train")
        log.info("from the stage thread")
        pool_thread = threading.Thread(target=lambda: log.info("from the task's own thread"))
        pool_thread.start()
        pool_thread.join()
        # a print under Prefect's log_prints: a record of the task-run logger made from user code
        logging.getLogger("prefect.task_runs").warning("printed in this context")
        stage_logger("other").info("not mine")
    with StageLog(other, "other"):
        pass
    text = train.read_text()
    assert text.startswith("--- attempt 1, ")
    assert "INFO    from the stage thread" in text and "from the task's own thread" in text
    assert "\nprinted in this context\n" in text  # as printed, without time and level
    assert "not mine" not in text
    assert seen[0] == "from the stage thread"  # the live view gets the message, without time and level
    left = [*stage_logger("train").handlers, *logging.getLogger("prefect.task_runs").handlers]
    assert not [h for h in left if type(h).__module__ == "conveyor.run.logs"]  # Prefect's own may be there


def test_find_log_picks_the_last_run_that_ran_the_stage(tmp_path: Path) -> None:
    for run, stage in [("20260101T000000-aaaaaa", "train"), ("20260102T000000-bbbbbb", "evaluate")]:
        path = log_path(tmp_path, run, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{run}\n")
    assert find_log(tmp_path, "train")[1] == "20260101T000000-aaaaaa"
    with pytest.raises(UsageError, match="did not run in run 20260102T000000-bbbbbb"):
        find_log(tmp_path, "train", "20260102T000000-bbbbbb")
    with pytest.raises(UsageError, match=r"no log of stage 'trian'.*\(did you mean 'train'\?\)"):
        find_log(tmp_path, "trian")


def test_the_logs_of_a_run_itself_are_not_listed_as_stages(tmp_path: Path) -> None:
    """run.log (Prefect, Dask, ...) and prefect-server.log (a temporary server's) are no stage's."""
    run = "20260101T000000-aaaaaa"
    for name in ("train", "run", "prefect-server"):
        path = log_path(tmp_path, run, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("lines\n")
    with pytest.raises(UsageError) as caught:
        find_log(tmp_path, "evaluate")
    assert str(caught.value).endswith("it has not run yet (stages with logs: train)")
    with pytest.raises(UsageError) as caught:
        find_log(tmp_path, "evaluate", run)
    assert str(caught.value) == f"stage 'evaluate' did not run in run {run} (it ran: train)"


def test_a_stage_of_another_dvc_yaml_is_listed_by_its_name(tmp_path: Path) -> None:
    """``sub/dvc.yaml:make`` (a stage of another dvc.yaml, issue 32) logs below the run's folder."""
    run = "20260101T000000-aaaaaa"
    for name in ("sub/dvc.yaml:make", "use", "run"):
        path = log_path(tmp_path, run, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("lines\n")
    assert find_log(tmp_path, "sub/dvc.yaml:make") == (log_path(tmp_path, run, "sub/dvc.yaml:make"), run)
    with pytest.raises(UsageError) as caught:
        find_log(tmp_path, "sub/dvc.yaml:mkae")
    assert str(caught.value).endswith("(did you mean 'sub/dvc.yaml:make'?): it has not run yet "
                                      "(stages with logs: sub/dvc.yaml:make, use)"), caught.value
    with pytest.raises(UsageError) as caught:
        find_log(tmp_path, "other", run)
    assert str(caught.value) == f"stage 'other' did not run in run {run} (it ran: sub/dvc.yaml:make, use)"


def test_metrics_are_the_numbers_of_the_declared_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"test": {"auc": 0.9, "ok": true, "name": "x"}, "n": 3}')
    (tmp_path / "b.yaml").write_text("loss: 0.25\n")
    (tmp_path / "bad.json").write_text("{not json")
    assert read_metrics(tmp_path / "a.json") == {"test.auc": 0.9, "n": 3.0}
    assert read_metrics(tmp_path / "bad.json") == {} and read_metrics(tmp_path / "missing.json") == {}
    assert stage_metrics(tmp_path, ["b.yaml"]) == {"loss": 0.25}
    assert stage_metrics(tmp_path, ["a.json", "b.yaml"]) == {"a.json:test.auc": 0.9, "a.json:n": 3.0,
                                                             "b.yaml:loss": 0.25}


CAPTURED = """
import logging, os, subprocess, sys, threading
from pathlib import Path
from conveyor.run.capture import capture_output
from conveyor.run.logs import StageLog

root = Path(sys.argv[1])
lib = logging.getLogger("somelib")
lib.addHandler(logging.StreamHandler())  # a library's own handler, made before the run, on stderr
lib.setLevel(logging.INFO)
with capture_output(root / "run.log", verbose=len(sys.argv) > 2) as console:
    console.print("the live view")
    print("a print outside any stage")
    with StageLog(root / "stage.log", "stage"):
        print("a print in the stage")
        lib.info("a library record in the stage")
    threading.Thread(target=lambda: print("a print from another thread")).start()
    os.write(2, b"a write to fd 2\\n")
    subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
print("after the run")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_capture_routes_every_kind_of_output(tmp_path: Path, verbose: bool) -> None:
    args = [sys.executable, "-c", CAPTURED, str(tmp_path), *(["-v"] if verbose else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    assert "the live view" in done.stderr and "after the run" in done.stdout
    stage = (tmp_path / "stage.log").read_text()
    assert "a print in the stage" in stage and "a library record in the stage" in stage
    run_log = (tmp_path / "run.log").read_text()
    for line in ("a print outside any stage", "a print from another thread", "a write to fd 2", "a child process"):
        assert line in run_log, line
        assert (line in terminal) is verbose, line
    assert ("a print in the stage" in terminal) is verbose
    assert not capture.active()
