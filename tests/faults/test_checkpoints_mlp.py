"""The reference MLP (torch, CPU) killed with kill -9 at 60 % of a 10-epoch training, in a process of
its own (``deterministic: true``) or under DDP on 2 Dask workers: the next run resumes it and ends
with the model and dvc.lock of a run never killed.

The kill is exact: the runner's environment puts a ``sitecustomize`` on ``PYTHONPATH`` that, once the
checkpoint of epoch ``KILL_AT_STEP`` is marked, SIGKILLs the ``conveyor run`` above the process
that marked it (the stage's, or rank 0's Dask worker), then that process itself (what a machine
going down does to both).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from projects import Project

# the kill at a step: what the checkpoint-resume benchmark measures with, one copy for both
from benchmarks.compute.checkpoint_resume import KILLER as KILL_AT

pytestmark = pytest.mark.slow


def ten_epochs(project: Project, *, ddp: bool) -> Project:
    """The reference project (git + DVC) with a 10-epoch MLP (a checkpoint after each epoch), its
    data preprocessed; ``ddp``: the MLP on the 2 workers of the ``cpu`` profile (DDP), not in a
    process of its own. A copy of it, run once whole, is returned: the run never killed."""
    params = yaml.safe_load((project.root / "params.yaml").read_text())
    params["train"]["mlp"] |= {"max_epochs": 10, "patience": 10}
    (project.root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if ddp:
        spec = (project.root / "configs/pipeline.yaml").read_text()
        # the data is small: DDP on the workers all the same, not in conveyor's process
        spec = spec.replace(", in_process_below: 64MiB", "").replace(
            "task: tasks.train:mlp_model\n    deterministic: true", "task: tasks.train:mlp_model\n    on: cpu #")
        assert "mlp_model\n    on: cpu" in spec and "in_process_below: 64MiB" not in spec
        (project.root / "configs/pipeline.yaml").write_text(spec)
    project.init_dvc()
    for step in (("compile",), ("run", "preprocess")):
        done = project.conveyor(*step)
        assert done.returncode == 0, done.stdout + done.stderr
    whole = Project(project.root.parent / f"{project.root.name}-whole", project.env, project.tag)
    shutil.copytree(project.root, whole.root, symlinks=True)
    done = whole.conveyor("run", "train_mlp")
    assert done.returncode == 0, done.stdout + done.stderr
    return whole


@pytest.mark.parametrize("ddp", [False, True], ids=["own-process", "ddp-on-2-workers"])
def test_the_mlp_killed_at_60_percent_resumes_to_the_model_of_a_run_never_killed(
        reference_project: Project, tmp_path: Path, ddp: bool) -> None:
    project = reference_project
    whole = ten_epochs(project, ddp=ddp)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AT)
    killed = project.conveyor("run", "train_mlp", env={"KILL_AT_STEP": "6", "PYTHONPATH": str(hook)})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert not project.left_running(grace_s=10), "a process outlived the killed run"
    (saved,) = (project.root / ".conveyor/checkpoints/train_mlp").glob("*/progress.json")
    assert json.loads(saved.read_text())["step"] == 6

    again = project.conveyor("run", "train_mlp")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "train_mlp resumes from epoch 6 of 10 (checkpoint of run " in again.stderr, again.stderr
    assert project.record()["stages"]["train_mlp"]["resumed"]["step"] == 6
    if ddp:  # trained by 2 ranks indeed, not in conveyor's process
        assert json.loads((project.root / "metrics/train_mlp.json").read_text())["world_size"] == 2
    assert (project.root / "models/mlp.pt").read_bytes() == (whole.root / "models/mlp.pt").read_bytes()
    locks = [yaml.safe_load((root / "dvc.lock").read_text()) for root in (project.root, whole.root)]
    assert locks[0] == locks[1]
    assert not (project.root / ".conveyor/checkpoints/train_mlp").exists()
