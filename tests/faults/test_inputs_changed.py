"""Params and deps edited while a stage runs: the record holds what the stage ran with.

DVC reads a stage's params and hashes its deps after its command (dvc#11058): edit
params.yaml while the stage runs and dvc.lock vouches for outs with values that never made
them, and `dvc status` is clean. conveyor records the deps and params as the stage started,
so the stage is stale afterwards, says why, and no run cache entry claims its outs came from
the new values.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest
import yaml
from projects import Project

pytestmark = pytest.mark.slow

# reads its param as it starts, then waits for the test to edit the inputs
STEP = """
import sys, time
from pathlib import Path

value = sys.argv[1] if len(sys.argv) > 1 else __import__("yaml").safe_load(open("params.yaml"))["lr"]
Path("started").write_text("")
while not Path("go").exists():
    time.sleep(0.02)
Path("out.txt").write_text(f"{value}\\n")
"""



def _dvc_project(make_project: Callable[[], Project], dvc_yaml: str) -> Project:
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", dvc_yaml)
    project.write("step.py", STEP)
    project.write("params.yaml", "lr: 0.1\n")
    project.init_dvc()
    return project


def _run_editing(project: Project, edit: Callable[[], None]) -> subprocess.CompletedProcess[str]:
    """``conveyor run``, with ``edit`` made while its stage runs."""
    proc = project.popen("run")
    deadline = time.monotonic() + 120
    while not (project.root / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the stage never started"
        time.sleep(0.02)
    edit()
    (project.root / "go").write_text("")
    out, _ = proc.communicate(timeout=120)  # stderr is merged into it
    (project.root / "started").unlink()  # "go" stays: later runs go straight through
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, out)


def _lock(project: Project) -> dict[str, object]:
    return dict(yaml.safe_load((project.root / "dvc.lock").read_text())["stages"]["step"])


def test_params_edited_while_a_stage_runs_are_recorded_as_it_ran_and_leave_it_stale(
        make_project: Callable[[], Project]) -> None:
    project = _dvc_project(make_project, "stages:\n  step:\n    cmd: python step.py\n    deps: [step.py]\n"
                                         "    params: [lr]\n    outs: [out.txt]\n")
    ran = _run_editing(project, lambda: project.write("params.yaml", "lr: 0.2\n"))
    assert ran.returncode == 0, ran.stderr
    assert (project.root / "out.txt").read_text() == "0.1\n"
    assert _lock(project)["params"] == {"params.yaml": {"lr": 0.1}}  # what made out.txt, not what is there now
    assert "step: params changed: lr 0.1 → 0.2: changed while it ran" in ran.stdout
    assert project.record()["stages"]["step"]["inputs_changed"] == ["params changed: lr 0.1 → 0.2"]
    status = project.conveyor("status")
    assert "stale" in status.stdout and "params changed: lr 0.1 → 0.2" in status.stdout, status.stdout
    assert "step" in project.sh("dvc", "status").stdout  # DVC agrees: not up to date

    again = project.conveyor("run")  # runs it (no run cache entry ties lr 0.2 to the old out.txt)
    assert again.returncode == 0, again.stderr
    assert "restored from DVC's run cache" not in again.stderr
    assert (project.root / "out.txt").read_text() == "0.2\n"
    assert _lock(project)["params"] == {"params.yaml": {"lr": 0.2}}
    assert "Data and pipelines are up to date" in project.sh("dvc", "status").stdout


def test_a_param_in_a_command_that_changed_is_named_not_called_a_command_change(
        make_project: Callable[[], Project]) -> None:
    project = _dvc_project(make_project, "stages:\n  step:\n    cmd: python step.py ${lr}\n    deps: [step.py]\n"
                                         "    outs: [out.txt]\n")
    ran = _run_editing(project, lambda: project.write("params.yaml", "lr: 0.2\n"))
    assert ran.returncode == 0, ran.stderr
    assert _lock(project)["cmd"] == "python step.py 0.1"
    status = project.conveyor("status")
    assert "params changed: lr 0.1 → 0.2" in status.stdout and "command changed" not in status.stdout, status.stdout
    project.write("dvc.yaml", "stages:\n  step:\n    cmd: python step.py ${lr} --verbose\n    deps: [step.py]\n"
                              "    outs: [out.txt]\n")
    assert "command changed" in project.conveyor("status").stdout  # the text itself changed: said so


TASKS = """
from pathlib import Path


def step(ctx):
    value = ctx.deps["data.txt"].read_text()
    Path("started").write_text("")
    while not Path("go").exists():
        __import__("time").sleep(0.02)
    ctx.out().write_text(value)
"""


def test_a_dep_edited_while_a_stage_runs_leaves_it_stale_in_conveyors_own_record(
        make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("data.txt", "old")
    project.write("configs/pipeline.yaml", "pipeline: p\nstages:\n"
                                           "  step: {task: tasks.steps:step, deps: [data.txt], outs: [out.txt]}\n")
    ran = _run_editing(project, lambda: project.write("data.txt", "new"))
    assert ran.returncode == 0, ran.stderr
    assert (project.root / "out.txt").read_text() == "old"
    assert "step: dep changed: data.txt: changed while it ran" in ran.stdout
    status = project.conveyor("status")
    assert "stale" in status.stdout and "dep changed: data.txt" in status.stdout, status.stdout
    assert project.conveyor("run").returncode == 0
    assert (project.root / "out.txt").read_text() == "new"
