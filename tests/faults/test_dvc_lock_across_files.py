"""A run of a pipeline across two dvc.yaml files, killed with entries recorded but not yet written
into either dvc.lock, loses no stage: each dvc.lock has a pending log of its own, and the next
run writes each entry into the dvc.lock beside the stage's own dvc.yaml (conveyor.dvc.lockfile).

    sub/dvc.yaml:one ──► two (dvc.yaml)
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import yaml
from projects import RUN_PENDING_AND_DIE, Project
from repos import dvc

pytestmark = pytest.mark.slow

SUB_YAML = """
    stages:
      one:
        cmd: echo {one} > one.txt
        outs: [one.txt]
"""
DVC_YAML = """
    stages:
      two:
        cmd: cat sub/one.txt > two.txt
        deps: [sub/one.txt]
        outs: [two.txt]
"""



def test_killed_with_entries_pending_in_two_dvc_locks_loses_no_stage(make_project: Callable[[], Project]) -> None:
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.init_dvc()
    project.write("sub/dvc.yaml", SUB_YAML.format(one="1"))
    project.write("dvc.yaml", DVC_YAML)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    before = {lock: (project.root / lock).read_bytes() for lock in ("dvc.lock", "sub/dvc.lock")}

    project.write("sub/dvc.yaml", SUB_YAML.format(one="2"))
    killed = subprocess.run([sys.executable, "-c", RUN_PENDING_AND_DIE], cwd=project.root, env=project.env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert {lock: (project.root / lock).read_bytes() for lock in before} == before  # never written
    assert (project.root / "two.txt").read_text() == "2\n"
    pending = [project.root / ".conveyor/dvc-lock-pending", project.root / ".conveyor/dvc-lock-pending--sub--dvc.lock"]
    assert all(log.is_file() for log in pending)

    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert {name: stage["status"] for name, stage in stages.items()} == {
        "sub/dvc.yaml:one": "skipped", "two": "skipped"}
    assert not any(log.exists() for log in pending)
    sub_lock = yaml.safe_load((project.root / "sub/dvc.lock").read_text())
    assert list(sub_lock["stages"]) == ["one"]  # beside its own dvc.yaml, under its own name
    assert "one" not in yaml.safe_load((project.root / "dvc.lock").read_text())["stages"]
    clean = dvc(project.root, "status")
    assert clean.returncode == 0 and "up to date" in clean.stdout, clean.stdout
