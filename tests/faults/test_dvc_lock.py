"""A run killed while dvc.lock is written leaves the previous dvc.lock, which DVC still reads.

DVC rewrites dvc.lock in place: killed mid-write, it is left empty or cut short, DVC refuses
it and the project's whole record is gone. conveyor records a stage through DVC's own
serializer but writes the file whole and renames it over the old one.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from projects import Project

pytestmark = pytest.mark.slow

DVC_YAML = """
    stages:
      one:
        cmd: echo 1 > one.txt
        outs: [one.txt]
      two:
        cmd: echo {two} > two.txt
        deps: [one.txt]
        outs: [two.txt]
"""

# Records stage `two` as `conveyor run` does, and is killed (SIGKILL) halfway through writing
# dvc.lock's new text: the worst moment for a file rewritten in place.
DIE_WRITING_THE_LOCK = """
import os, pathlib, signal, sys
from conveyor.dvc.record import DvcRecord
from conveyor.spec.project import load_project

write_text = pathlib.Path.write_text

def dying(self, text, *args, **kwargs):
    if "dvc.lock" in self.name:
        with open(self, "w", encoding="utf-8") as fh:
            fh.write(text[: len(text) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return write_text(self, text, *args, **kwargs)

pathlib.Path.write_text = dying
record = DvcRecord(load_project(pathlib.Path("dvc.yaml").resolve()))
with record.session():
    record.save("two")
"""


def test_killed_while_writing_dvc_lock_leaves_the_previous_one_readable(
        make_project: Callable[[], Project]) -> None:
    project = make_project()
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        subprocess.run(command, cwd=project.root, check=True, capture_output=True)
    project.write("dvc.yaml", DVC_YAML.format(two="2"))
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    before = (project.root / "dvc.lock").read_bytes()

    project.write("dvc.yaml", DVC_YAML.format(two="3"))
    (project.root / "two.txt").write_text("3\n")
    killed = subprocess.run([sys.executable, "-c", DIE_WRITING_THE_LOCK], cwd=project.root, env=project.env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr

    assert (project.root / "dvc.lock").read_bytes() == before
    status = subprocess.run(["dvc", "status"], cwd=project.root, capture_output=True, text=True)
    assert status.returncode == 0 and "two" in status.stdout and "one:" not in status.stdout, status
    untracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project.root,
                               capture_output=True, text=True, check=True).stdout
    assert ".tmp" not in untracked  # the half-written text stayed in .conveyor/, out of sight

    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert (stages["one"]["status"], stages["two"]["status"]) == ("skipped", "succeeded")
    clean = subprocess.run(["dvc", "status"], cwd=project.root, capture_output=True, text=True)
    assert clean.returncode == 0 and "up to date" in clean.stdout, clean.stdout
