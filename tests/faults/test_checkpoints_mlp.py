"""The reference MLP (torch, CPU, in a process of its own: ``deterministic: true``) killed with kill -9
at 60 % of a 10-epoch training: the next run resumes it and ends with the model and dvc.lock of a
run never killed.

The kill is exact: the runner's environment puts a ``sitecustomize`` on ``PYTHONPATH`` that, once the
checkpoint of epoch ``KILL_AT_STEP`` is marked, SIGKILLs the ``conveyor run`` above the stage's
process, then that process itself (what a machine going down does to both).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from projects import Project

pytestmark = pytest.mark.slow
MakeProject = Callable[[], Project]

KILL_AT = '''
import os, signal
if os.environ.get("KILL_AT_STEP"):
    import conveyor.run.checkpoints as _checkpoints

    _mark = _checkpoints.Checkpoint.mark

    def _mark_then_die(self, step, *args, **kwargs):
        _mark(self, step, *args, **kwargs)
        if step >= int(os.environ["KILL_AT_STEP"]):
            import psutil

            for parent in psutil.Process().parents():
                if "conveyor" in " ".join(parent.cmdline()[:2]) and "run" in parent.cmdline()[1:3]:
                    os.kill(parent.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    _checkpoints.Checkpoint.mark = _mark_then_die
'''


def test_the_mlp_killed_at_60_percent_resumes_to_the_model_of_a_run_never_killed(
        reference_project: Project, make_project: MakeProject, tmp_path: Path) -> None:
    project = reference_project
    params = yaml.safe_load((project.root / "params.yaml").read_text())
    params["train"]["mlp"] |= {"max_epochs": 10, "patience": 10}  # ten epochs, a checkpoint after each
    (project.root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    project.init_dvc()
    for step in (("compile",), ("run", "preprocess")):
        done = project.conveyor(*step)
        assert done.returncode == 0, done.stdout + done.stderr
    whole = make_project()
    shutil.copytree(project.root, whole.root, symlinks=True, dirs_exist_ok=True)
    done = whole.conveyor("run", "train_mlp")
    assert done.returncode == 0, done.stdout + done.stderr

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AT)
    killed = project.conveyor("run", "train_mlp", env={"KILL_AT_STEP": "6", "PYTHONPATH": str(hook)})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert not project.left_running(grace_s=5), "a process outlived the killed run"
    (saved,) = (project.root / ".conveyor/checkpoints/train_mlp").glob("*/progress.json")
    assert json.loads(saved.read_text())["step"] == 6

    again = project.conveyor("run", "train_mlp")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "train_mlp resumes from epoch 6 of 10 (checkpoint of run " in again.stderr, again.stderr
    assert project.record()["stages"]["train_mlp"]["resumed"]["step"] == 6
    assert (project.root / "models/mlp.pt").read_bytes() == (whole.root / "models/mlp.pt").read_bytes()
    locks = [yaml.safe_load((root / "dvc.lock").read_text()) for root in (project.root, whole.root)]
    assert locks[0] == locks[1]
    assert not (project.root / ".conveyor/checkpoints/train_mlp").exists()
