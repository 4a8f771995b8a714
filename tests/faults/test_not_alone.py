"""conveyor is never alone: after a killed run, `dvc repro` writes and records the stage's outs;
the journal of the killed run must not put its older outs back over them.

The journal moves a stage's previous outs aside before it runs and, when the runner was
killed, the next conveyor command moves them back. Between the two, another tool may have
run the stage and recorded what it wrote: those outs are the ones the record vouches for,
and a `cache: false` metrics file overwritten by the older one would be gone for good.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable

import pytest
from projects import Project

pytestmark = pytest.mark.slow

DVC_YAML = """
stages:
  slow:
    cmd: python write.py ${n}
    params: [n]
    outs: [out.txt]
    metrics: [{m.json: {cache: false}}]
"""

WRITE = """
import json, sys, time
from pathlib import Path

n = int(sys.argv[1])
Path("out.txt").write_text("partial")
if Path("hang").exists():
    Path("hang.started").write_text("")
    time.sleep(600)
Path("out.txt").write_text(f"{n}\\n")
Path("m.json").write_text(json.dumps({"n": n}))
"""



def _dvc_project(make_project: Callable[[], Project]) -> Project:
    """A plain DVC project (no conveyor spec): git, DVC, the one-stage dvc.yaml above, n = 1."""
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", DVC_YAML)
    project.write("write.py", WRITE)
    project.write("params.yaml", "n: 1\n")
    project.init_dvc()
    return project


def _hanging(project: Project, *args: str) -> subprocess.Popen[str]:
    """``conveyor ARGS`` once its stage has written half of out.txt and hangs."""
    (project.root / "hang").write_text("")
    proc = project.popen(*args)
    deadline = time.monotonic() + 120
    while not (project.root / "hang.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the stage never started"
        time.sleep(0.05)
    return proc


def test_outs_that_dvc_repro_recorded_after_a_killed_run_are_never_replaced_by_its_journal(
        make_project: Callable[[], Project]) -> None:
    project = _dvc_project(make_project)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stderr
    assert (project.root / "out.txt").read_text() == "1\n"

    proc = _hanging(project, "run", "-f")
    proc.kill()  # kill -9: its journal entry (the previous outs) stays for the next command
    proc.communicate(timeout=30)
    assert not project.left_running(grace_s=5)
    assert list((project.root / ".conveyor/journal").iterdir())

    (project.root / "hang").unlink()
    project.write("params.yaml", "n: 2\n")
    project.sh("dvc", "repro")  # another tool runs the stage and records what it wrote
    assert (project.root / "out.txt").read_text() == "2\n"

    status = project.conveyor("status")
    assert status.returncode == 0, status.stderr
    assert "kept the outs of 'slow' in place" in status.stderr, status.stderr
    assert "put back the previous outs" not in status.stderr
    assert (project.root / "out.txt").read_text() == "2\n"  # dvc repro's, as dvc.lock records
    assert json.loads((project.root / "m.json").read_text()) == {"n": 2}
    assert not list((project.root / ".conveyor/journal").iterdir())
    assert "Data and pipelines are up to date" in project.sh("dvc", "status").stdout
    record = project.record()
    assert record["status"] == "interrupted" and record["stages"]["slow"]["status"] == "interrupted"


def test_a_killed_run_whose_outs_no_one_recorded_still_gets_its_previous_outs_back(
        make_project: Callable[[], Project]) -> None:
    project = _dvc_project(make_project)
    assert project.conveyor("run").returncode == 0
    proc = _hanging(project, "run", "-f")
    proc.kill()
    proc.communicate(timeout=30)
    assert (project.root / "out.txt").read_text() == "partial"

    status = project.conveyor("status")
    assert "put back the previous outs of 'slow'" in status.stderr, status.stderr
    assert (project.root / "out.txt").read_text() == "1\n"
    assert json.loads((project.root / "m.json").read_text()) == {"n": 1}


def test_exec_beside_a_run_refuses_in_one_line(make_project: Callable[[], Project]) -> None:
    """`conveyor exec STAGE` (what dvc repro calls) takes the run lock a run holds: two processes
    never write one out."""
    project = _dvc_project(make_project)
    proc = _hanging(project, "run")
    try:
        beside = project.conveyor("exec", "slow")
        assert beside.returncode == 1, beside.stdout + beside.stderr
        assert beside.stderr.strip().startswith("another conveyor run holds") and "Traceback" not in beside.stderr
        assert len(beside.stderr.strip().splitlines()) == 1
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert not (project.root / "out.txt").exists()  # it had no previous version: what the run began is gone
    assert not project.left_running(grace_s=5)
