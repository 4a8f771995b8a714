"""`status` names what no fingerprint holds: package versions, the CPU's kernels, code a command's deps miss.

A package upgrade or another CPU changes a model's bytes without changing a dep, a param or
the stage's code: the stage is not stale (dvc.lock stays DVC's), but `status` and the run's
summary say what changed since its last run, from the run records. A script that imports a
local module its stage does not declare is a change DVC would miss: `validate` and `status`
name the import and the line to add.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from projects import Project

TASKS = '''
import numpy as np


def table(ctx):
    ctx.out().write_text(str(np.arange(3).sum()))
'''

SPEC = '''
pipeline: env
stages:
  loose: {task: tasks.steps:table, outs: [out/loose.txt]}
  pinned: {task: tasks.steps:table, deterministic: true, outs: [out/pinned.txt]}
'''


def _edit_last_record(project: Project, edit: Callable[[dict[str, object]], None]) -> None:
    """Rewrite the last run's record as an older version of this machine would have left it."""
    path = project.root / f".conveyor/runs/{project.record()['run_id']}.json"
    record = json.loads(path.read_text())
    for stage in record["stages"].values():
        edit(stage)
    path.write_text(json.dumps(record))


def test_status_names_a_package_upgrade_and_another_cpu_without_calling_the_stage_stale(
        make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("configs/pipeline.yaml", SPEC)
    (project.root / "out").mkdir()
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    stages = project.record()["stages"]
    assert stages["loose"]["packages"]["numpy"] == np.__version__  # what the task's module imports
    assert "conveyor" not in stages["loose"]["packages"] or stages["loose"]["packages"]["conveyor"]
    assert stages["loose"]["cpu"]["threads"]

    def older_numpy_on_another_cpu(stage: dict[str, object]) -> None:
        stage["packages"] = {**stage["packages"], "numpy": "1.26.4"}  # type: ignore[dict-item]
        stage["cpu"] = {**stage["cpu"], "isa": "x86-64-v2"}  # type: ignore[dict-item]

    _edit_last_record(project, older_numpy_on_another_cpu)
    status = project.conveyor("status", "--exit-code", env={"COLUMNS": "400"})
    assert status.returncode == 0, status.stdout + status.stderr  # information, not a reason to run
    lines = {line.split("│")[1].strip(): line for line in status.stdout.splitlines() if line.count("│") > 2}
    assert f"environment changed since the last run: numpy 1.26.4 → {np.__version__}" in lines["loose"]
    assert "CPU kernels changed since the last run: isa x86-64-v2 →" in lines["loose"]
    assert f"numpy 1.26.4 → {np.__version__}" in lines["pinned"]
    assert "CPU kernels" not in lines["pinned"]  # pinned: the CPU did not decide its bytes
    assert "up to date" in lines["loose"] and "up to date" in lines["pinned"]

    # a run that reruns the stage says it in its reason (the summary and the record)
    again = project.conveyor("run", "-f", "loose", env={"COLUMNS": "400"})
    assert again.returncode == 0
    assert f"numpy 1.26.4 → {np.__version__}" in project.record()["stages"]["loose"]["reason"]


SCRIPT = '''
from helpers import double


def main():
    import json
    print(json.dumps(double(2)))


main()
'''


def test_a_script_importing_a_local_module_its_deps_miss_is_named_with_the_line_to_add(
        make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("scripts/train.py", SCRIPT)
    project.write("scripts/helpers.py", "def double(x):\n    return 2 * x\n")
    spec = project.write("configs/pipeline.yaml", '''
        pipeline: scripts
        stages:
          train: {cmd: python scripts/train.py > out.txt, deps: [scripts/train.py], outs: [out.txt]}
        ''')
    for command in ("validate", "status"):
        done = project.conveyor(command, env={"COLUMNS": "400"})
        assert done.returncode == 0, done.stderr
        assert ("warning: configs/pipeline.yaml stages.train: scripts/train.py:1 imports 'helpers' "
                "(scripts/helpers.py), which is not among its deps: a change to it will not rerun the stage; "
                "add 'scripts/helpers.py' to its deps") in done.stderr, command

    spec.write_text(spec.read_text().replace("deps: [scripts/train.py]", "deps: [scripts]"))
    assert "warning" not in project.conveyor("validate").stderr
    spec.write_text(spec.read_text().replace("deps: [scripts]", "deps: []"))
    assert "it runs scripts/train.py, which is not among its deps" in project.conveyor("validate").stderr
    assert Path(project.root / "scripts/helpers.py").exists()
