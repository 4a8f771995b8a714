"""Questions need no writes; a run that cannot write says so in one line (issue 31, item 9).

The other actors here are the file system itself: a read-only checkout (a CI cache, an NFS
copy: a read-only bind mount, since root writes through chmod), a full disk (a tiny tmpfs),
and a run in progress that holds the locks while ``status`` is asked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from projects import Project
from repos import ANALYTICS_OFF, git_dvc_init

pytestmark = pytest.mark.slow

DVC_YAML = """
    stages:
      one:
        cmd: echo 1 > one.txt
        outs: [one.txt]
      two:
        cmd: {two}
        deps: [one.txt]
        outs: [two.txt]
"""


def _sh(root: Path, *args: str) -> None:
    done = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, check=True)


def _dvc_project(make_project: Callable[[], Project], two: str = "cat one.txt > two.txt") -> Project:
    """A plain DVC project (git, DVC, no conveyor spec) of two stages, ``two`` running ``two``."""
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", DVC_YAML.format(two=two))
    git_dvc_init(project.root, ANALYTICS_OFF)
    return project


def _ran(make_project: Callable[[], Project]) -> Project:
    project = _dvc_project(make_project)
    done = project.conveyor("run")
    assert done.returncode == 0, done.stdout + done.stderr
    return project


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """``read_only(folder)``: a read-only view of ``folder`` (a bind mount), unmounted at the end."""
    mounted: list[Path] = []

    def mount(folder: Path) -> Path:
        view = tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
        view.mkdir()
        bound = _mount("--bind", str(folder), str(view))
        if bound.returncode != 0:
            pytest.skip(f"no bind mount here (needs root or CAP_SYS_ADMIN): {bound.stderr.strip()}")
        mounted.append(view)
        ro = _mount("-o", "remount,bind,ro", str(view))
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {ro.stderr.strip()}")
        return view

    yield mount
    for view in reversed(mounted):
        _umount(view)


@pytest.fixture
def tiny_disk() -> Iterator[Callable[[Path], None]]:
    """``tiny_disk(folder)``: a 1 MiB tmpfs mounted on ``folder``, unmounted at the end."""
    mounted: list[Path] = []

    def mount(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        done = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder))
        if done.returncode != 0:
            pytest.skip(f"no tmpfs mount here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(folder)

    yield mount
    for folder in reversed(mounted):
        _umount(folder)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time: what a write would change."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_questions_answer_on_a_read_only_checkout_and_write_nothing(
        make_project: Callable[[], Project], read_only: Callable[[Path], Path]) -> None:
    project = _ran(make_project)
    before = _tree(project.root)
    copy = Project(read_only(project.root), project.env, project.tag)

    status = copy.conveyor("status")
    assert status.returncode == 0 and status.stderr == "", status.stdout + status.stderr
    assert status.stdout.count("up to date") == 2, status.stdout
    for question in (["dag"], ["runs"], ["logs", "one"], ["run", "--dry-run"]):
        done = copy.conveyor(*question)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (question, done.stdout + done.stderr)
    assert "succeeded" in copy.conveyor("runs").stdout
    assert _tree(project.root) == before


def test_questions_answer_on_a_fresh_read_only_clone_of_a_spec_project(
        make_project: Callable[[], Project], read_only: Callable[[Path], Path]) -> None:
    """No .conveyor/ at all (it is not in git), so no record: every stage is stale, and nothing is made."""
    project = make_project()
    project.write("configs/pipeline.yaml", "pipeline: demo\nstages:\n  make: {task: tasks.steps:make, outs: [o.txt]}\n")
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", "def make(ctx):\n    (ctx.root / 'o.txt').write_text('1')\n")
    copy = Project(read_only(project.root), project.env, project.tag)

    for question in (["status"], ["run", "--dry-run"], ["dag"], ["runs"]):
        done = copy.conveyor(*question)
        assert done.returncode == 0 and done.stderr == "", (question, done.stdout + done.stderr)
    assert "never run" in copy.conveyor("status").stdout
    logs = copy.conveyor("logs", "make")
    assert logs.returncode == 2 and "it has not run yet" in _one_line(logs), logs.stderr
    assert not (project.root / ".conveyor").exists()


def test_a_run_on_a_read_only_checkout_names_the_path_and_the_errno_in_one_line(
        make_project: Callable[[], Project], read_only: Callable[[Path], Path]) -> None:
    project = _ran(make_project)
    before = _tree(project.root)
    copy = Project(read_only(project.root), project.env, project.tag)

    done = copy.conveyor("run", "--force")
    assert done.returncode == 1, done.stdout + done.stderr
    line = _one_line(done)
    assert str(copy.root / ".conveyor") in line and "Read-only file system (EROFS)" in line, line
    assert _tree(project.root) == before
    assert project.left_running() == []


def _open_when_read(fifo: Path) -> tuple[threading.Thread, list[int]]:
    """Open ``fifo`` for writing in a thread: the open returns once the stage opened it to read."""
    opened: list[int] = []
    thread = threading.Thread(target=lambda: opened.append(os.open(fifo, os.O_WRONLY)), daemon=True)
    thread.start()
    return thread, opened


def test_status_during_a_run_says_so_and_answers_from_the_state_before_it(
        make_project: Callable[[], Project], tmp_path: Path) -> None:
    project = _ran(make_project)
    fifo = tmp_path / f"go-{uuid.uuid4().hex[:6]}"
    os.mkfifo(fifo)
    project.write("dvc.yaml", DVC_YAML.format(two=f"cat {fifo} > /dev/null && cat one.txt > two.txt"))
    run = project.popen("run")
    thread, opened = _open_when_read(fifo)
    thread.join(timeout=180)
    try:
        assert opened, "the stage never started"  # it is blocked in its command now, outs moved aside
        status = project.conveyor("status")
    finally:  # let the stage go on: EOF on its fifo (or, if it never opened it, no writer left waiting)
        os.close(opened[0] if opened else os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        output, _ = run.communicate(timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"a run is in progress (pid {run.pid})" in status.stderr, status.stderr
    rows = {line.split()[1]: line for line in status.stdout.splitlines() if line.startswith("│")}
    assert "up to date" in rows["one"] and "command changed" in rows["two"], status.stdout
    assert "missing" not in status.stdout, status.stdout  # two's outs are in the journal, not gone
    assert run.returncode == 0, output
    after = project.conveyor("status")
    assert after.stdout.count("up to date") == 2 and after.stderr == "", after.stdout + after.stderr


def test_a_full_disk_at_the_record_keeps_the_stages_in_dvc_lock_and_says_so_in_one_line(
        make_project: Callable[[], Project], tiny_disk: Callable[[Path], None]) -> None:
    filler = "head -c 4000000 /dev/zero > .conveyor/runs/filler; cat one.txt > two.txt"
    project = _dvc_project(make_project, two=filler)
    (project.root / ".conveyor").mkdir()
    (project.root / ".conveyor/.gitignore").write_text("*\n")
    tiny_disk(project.root / ".conveyor/runs")

    done = project.conveyor("run")
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr, done.stderr
    assert str(project.root / ".conveyor/runs") in line and "No space left on device (ENOSPC)" in line, line
    stages = yaml.safe_load((project.root / "dvc.lock").read_text())["stages"]
    assert set(stages) == {"one", "two"}, stages
    assert (project.root / "two.txt").read_text() == "1\n"
    assert project.left_running() == []

    (project.root / ".conveyor/runs/filler").unlink()  # space again: the next command settles the record
    status = project.conveyor("status")
    assert status.returncode == 0 and status.stdout.count("up to date") == 2, status.stdout + status.stderr
    record = project.record()  # settled from its events: the stages' outcomes as they were
    assert record["status"] == "interrupted", record
    assert {s["status"] for s in record["stages"].values()} == {"succeeded"}, record["stages"]


def test_a_disk_full_before_the_run_names_the_file_it_could_not_write(
        make_project: Callable[[], Project], tiny_disk: Callable[[Path], None]) -> None:
    """The run lock is conveyor's first write: a full disk fails it with the lock's path (the write
    names no file: the line said "cannot write None"), and nothing runs."""
    project = _dvc_project(make_project)
    (project.root / ".conveyor").mkdir()
    tiny_disk(project.root / ".conveyor")
    (project.root / ".conveyor/.gitignore").write_text("*\n")
    with pytest.raises(OSError, match="No space left"), (project.root / ".conveyor/filler").open("wb") as fh:
        fh.write(b"\0" * 2_000_000)

    done = project.conveyor("run")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"cannot write {project.root / '.conveyor/run.lock'}: No space left on device (ENOSPC): free some space, "
        "then run again (what succeeded stays recorded)")
    assert not (project.root / "one.txt").exists() and not (project.root / "dvc.lock").exists()


def test_a_full_disk_loses_an_events_line_not_the_run(tmp_path: Path, tiny_disk: Callable[[Path], None]) -> None:
    """The events only settle a killed run: a line that does not fit must not end the run (and leave
    the stages still running unrecorded)."""
    from conveyor.run.record import RunEvents, StageRecord

    tiny_disk(tmp_path / ".conveyor/runs")
    (tmp_path / ".conveyor/.gitignore").write_text("*\n")
    with pytest.raises(OSError, match="No space left"), (tmp_path / ".conveyor/runs/filler").open("wb") as fh:
        fh.write(b"\0" * 2_000_000)
    events = RunEvents(tmp_path, "run-1")
    events.stage("one", StageRecord(status="succeeded", reason="x" * 8192))
    assert b"\n" not in events.path.read_bytes()  # nothing, or a line cut short: settling skips it
