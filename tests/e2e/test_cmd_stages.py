"""cmd stages and in-place outs end to end: the real CLI, a real Dask cluster, kill -9 of the runner.

The pipeline::

    source (a task, writes in place) ──► double (a cmd on the dask profile) ──► report (a local cmd)

Each stage reads ``faults/<stage>`` (not a dep: it changes no fingerprint): ``raise``/``fail``
writes half of its out and fails, ``hang`` writes half, touches ``faults/<stage>.writing``
and sleeps, so the test can kill the runner in the middle of a write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil
import pytest
from projects import Project
from subprocs import wait_for

TASKS = '''
import time
from pathlib import Path


def source(ctx):
    fault = ctx.root / "faults/source"
    mode = fault.read_text().strip() if fault.exists() else "ok"
    out = ctx.root / "data/source.txt"                       # in place, as a script would
    out.write_text("partial")
    if mode == "raise":
        raise RuntimeError("source broke after a partial write")
    if mode == "hang":
        (ctx.root / "faults/source.writing").write_text("")
        while True:
            time.sleep(0.05)
    out.write_text(f"{ctx.params['source']['value']}\\n")
'''

STAGE_SCRIPT = '''
import sys, time
from pathlib import Path

stage, src, dst, factor = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
fault = Path("faults") / stage
mode = fault.read_text().strip() if fault.exists() else "ok"
dst.parent.mkdir(parents=True, exist_ok=True)
with dst.open("w") as fh:
    fh.write("partial")
    fh.flush()
    if mode == "fail":
        print(f"{stage}: bad input, giving up", file=sys.stderr)
        sys.exit(3)
    if mode == "hang":
        Path(f"faults/{stage}.writing").write_text("")
        time.sleep(600)
    value = int(src.read_text()) * factor
    fh.seek(0)
    fh.truncate()
    fh.write(f"{value}\\n")
print(f"{stage}: wrote {value}")
'''

SPEC = """
pipeline: commands
profiles:
  cpu: {kind: dask, n_workers: 1, threads_per_worker: 1, memory_limit: 1GiB}
stages:
  source:
    task: tasks.steps:source
    params: [source]
    outs: [data/source.txt]
  double:
    cmd: python scripts/stage.py double data/source.txt data/double.txt ${double.factor}
    on: cpu
    deps: [data/source.txt, scripts/stage.py]
    params: [double]
    outs: [data/double.txt]
  report:
    cmd: python scripts/stage.py report data/double.txt reports/summary.txt ${report.factor}
    deps: [data/double.txt, scripts/stage.py]
    params: [report]
    outs: [reports/summary.txt]
    timeout_s: 4
"""

OUTS = {"source": "data/source.txt", "double": "data/double.txt", "report": "reports/summary.txt"}


def commands_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("scripts/stage.py", STAGE_SCRIPT)
    project.write("configs/pipeline.yaml", SPEC)
    set_params(project)
    project.write("faults/.keep", "")
    return project


def set_params(project: Project, *, value: int = 5, double: int = 2, report: int = 10) -> None:
    project.write("params.yaml", f"source: {{value: {value}}}\ndouble: {{factor: {double}}}\n"
                                 f"report: {{factor: {report}}}\n")


def outs(project: Project) -> dict[str, str]:
    return {stage: (project.root / rel).read_text() for stage, rel in OUTS.items()}


def statuses(project: Project) -> dict[str, str]:
    return {name: stage["status"] for name, stage in project.record()["stages"].items()}


def first_run(project: Project) -> dict[str, str]:
    done = project.conveyor("run")
    assert done.returncode == 0, done.stderr
    assert outs(project) == {"source": "5\n", "double": "10\n", "report": "100\n"}
    return outs(project)


@pytest.mark.slow
def test_a_cmd_on_a_dask_worker_and_a_local_cmd_run_and_are_recorded(make_project: Callable[[], Project]) -> None:
    project = commands_project(make_project)
    first_run(project)
    record = project.record()
    assert {n: s["profile"] for n, s in record["stages"].items()} == {
        "source": "local", "double": "cpu", "report": "local"}
    log = (project.root / f".conveyor/logs/{record['run_id']}/double.log").read_text()
    assert "double: wrote 10" in log

    set_params(project, double=3)  # the interpolated command changes: double and what follows rerun
    assert project.conveyor("run").returncode == 0
    assert statuses(project) == {"source": "skipped", "double": "succeeded", "report": "succeeded"}
    assert project.record()["stages"]["double"]["reason"] == "params changed: double.factor 2 → 3; command changed"
    assert outs(project)["report"] == "150\n"
    assert not project.left_running()

    single = project.conveyor("exec", "double")  # what dvc repro would call for a task; a cmd runs the same way
    assert single.returncode == 0, single.stderr
    assert "double: wrote 15" in single.stdout  # the command's output on the terminal
    assert not project.left_running()


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "mode", "error"), [
    ("source", "raise", "RuntimeError: source broke after a partial write"),
    ("double", "fail", "command exited with status 3; last lines of stderr:\n  double: bad input, giving up"),
    ("report", "hang", "timed out after 4s (timeout_s); its processes were killed"),
])
def test_a_failed_stage_leaves_its_previous_outs(make_project: Callable[[], Project], stage: str, mode: str,
                                                 error: str) -> None:
    project = commands_project(make_project)
    before = first_run(project)
    set_params(project, value=6, double=4, report=20)  # every stage is due
    project.write(f"faults/{stage}", mode)

    done = project.conveyor("run")

    assert done.returncode == 1
    assert project.record()["stages"][stage]["status"] == "failed"
    assert error in done.stdout.replace("│", "")  # the summary's error column may wrap; the message is whole
    assert (project.root / OUTS[stage]).read_text() == before[stage]  # never "partial"
    assert not list((project.root / ".conveyor/journal").iterdir())
    assert not project.left_running()


def popen_run(project: Project) -> subprocess.Popen[bytes]:
    log = (project.root / "runner.log").open("wb")
    return subprocess.Popen(["conveyor", "run"], cwd=project.root, env=project.env, stdout=log,
                            stderr=subprocess.STDOUT)


def gone_within(project: Project, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := project.tagged_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["source", "double", "report"])
def test_kill_9_of_the_runner_mid_write(make_project: Callable[[], Project], stage: str) -> None:
    """No process of the run is left after 5 s; the next status puts the previous out back; the
    resumed run reruns only the stage that was killed (and what follows it), not what finished."""
    project = commands_project(make_project)
    before = first_run(project)
    factors = {"source": {"value": 6}, "double": {"double": 4}, "report": {"report": 20}}[stage]
    set_params(project, **factors)  # only this stage (and what follows) is due
    project.write(f"faults/{stage}", "hang")
    runner = popen_run(project)
    wait_for(project.root / f"faults/{stage}.writing", runner)
    assert (project.root / OUTS[stage]).read_text() == "partial"

    os.kill(runner.pid, signal.SIGKILL)
    runner.wait()

    assert gone_within(project, 5) == []
    assert (project.root / OUTS[stage]).read_text() == "partial"  # nobody has cleaned up yet
    status = project.conveyor("status")
    assert status.returncode == 0, status.stderr
    assert f"put back the previous outs of '{stage}': its last run was killed" in status.stderr
    assert outs(project) == before

    (project.root / f"faults/{stage}").unlink()
    resumed = project.conveyor("run")
    assert resumed.returncode == 0, resumed.stderr
    order = list(OUTS)
    expected = {s: "skipped" if order.index(s) < order.index(stage) else "succeeded" for s in order}
    assert statuses(project) == expected
    assert not project.left_running()
