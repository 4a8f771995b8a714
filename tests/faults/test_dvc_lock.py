"""A run killed while dvc.lock is written leaves the previous dvc.lock, which DVC still reads.

DVC rewrites dvc.lock in place: killed mid-write, it is left empty or cut short, DVC refuses
it and the project's whole record is gone. conveyor records a stage through DVC's own
serializer but writes the file whole and renames it over the old one.

conveyor also writes dvc.lock in batches (conveyor.dvc.lockfile): an entry recorded but not yet
written is in the pending log, and a run killed before writing it loses no stage: the next run
writes the entry, unless someone recorded after the kill (a `dvc repro`: theirs wins) or the
stage's outs changed since (then it runs again).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from projects import RUN_PENDING_AND_DIE, Project
from repos import dvc, git_dvc_init

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
    git_dvc_init(project.root)
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
    status = dvc(project.root, "status")
    assert status.returncode == 0 and "two" in status.stdout and "one:" not in status.stdout, status
    untracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project.root,
                               capture_output=True, text=True, check=True).stdout
    assert ".tmp" not in untracked  # the half-written text stayed in .conveyor/, out of sight

    again = project.conveyor("run")  # two's entry, in the pending log before the write, is written now
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert (stages["one"]["status"], stages["two"]["status"]) == ("skipped", "skipped")
    assert "echo 3" in (project.root / "dvc.lock").read_text()
    clean = dvc(project.root, "status")
    assert clean.returncode == 0 and "up to date" in clean.stdout, clean.stdout




def killed_with_entries_pending(make_project: Callable[[], Project]) -> tuple[Project, bytes]:
    """A project run once (two says 2), then run with two saying 3 and killed with two's new entry
    recorded in the pending log only; the project and its dvc.lock as the first run left it."""
    project = make_project()
    git_dvc_init(project.root)
    project.write("dvc.yaml", DVC_YAML.format(two="2"))
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    before = (project.root / "dvc.lock").read_bytes()
    project.write("dvc.yaml", DVC_YAML.format(two="3"))
    killed = subprocess.run([sys.executable, "-c", RUN_PENDING_AND_DIE], cwd=project.root, env=project.env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert (project.root / "dvc.lock").read_bytes() == before  # never written
    assert (project.root / "two.txt").read_text() == "3\n"  # the journal let go of the previous outs
    assert (project.root / ".conveyor/dvc-lock-pending").is_file()
    return project, before


def test_killed_with_entries_pending_loses_no_stage(make_project: Callable[[], Project]) -> None:
    project, _ = killed_with_entries_pending(make_project)
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert (stages["one"]["status"], stages["two"]["status"]) == ("skipped", "skipped")
    assert (project.root / "two.txt").read_text() == "3\n"
    assert not (project.root / ".conveyor/dvc-lock-pending").exists()
    clean = dvc(project.root, "status")
    assert clean.returncode == 0 and "up to date" in clean.stdout, clean.stdout


def test_a_dvc_repro_after_the_kill_wins_over_the_pending_log(make_project: Callable[[], Project]) -> None:
    """dvc repro writes dvc.lock after the kill: the pending log, started on the older file, is dropped."""
    project, before = killed_with_entries_pending(make_project)
    repro = subprocess.run(["dvc", "repro"], cwd=project.root, capture_output=True, text=True)
    assert repro.returncode == 0, repro.stdout + repro.stderr
    by_dvc = (project.root / "dvc.lock").read_bytes()
    assert by_dvc != before
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert {s["status"] for s in project.record()["stages"].values()} == {"skipped"}
    assert (project.root / "dvc.lock").read_bytes() == by_dvc
    assert not (project.root / ".conveyor/dvc-lock-pending").exists()


def test_outs_changed_after_the_kill_are_not_recorded_from_the_pending_log(
        make_project: Callable[[], Project]) -> None:
    """two.txt edited by hand after the kill: its pending entry no longer describes it, so it is not
    written; two runs again (and dvc.lock never claims the edited file came from the command)."""
    project, _ = killed_with_entries_pending(make_project)
    (project.root / "two.txt").write_text("edited\n")
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert (stages["one"]["status"], stages["two"]["status"]) == ("skipped", "succeeded")
    assert (project.root / "two.txt").read_text() == "3\n"
    clean = dvc(project.root, "status")
    assert clean.returncode == 0 and "up to date" in clean.stdout, clean.stdout
