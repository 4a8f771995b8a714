"""The project's state folder and run lock: runs one at a time, decided at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocs import holding

from conveyor.errors import RunLockedError
from conveyor.workspace import run_holder, run_lock, state_dir


def test_the_state_folder_ignores_itself_in_git(tmp_path: Path) -> None:
    folder = state_dir(tmp_path)
    assert folder == tmp_path / ".conveyor"
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (folder / "runs").mkdir()
    (folder / "runs" / "latest.json").write_text("{}")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True)
    assert status.stdout == ""


TAKE_LOCK = """
import sys, time
from pathlib import Path
from conveyor.errors import RunLockedError
from conveyor.workspace import run_lock
start = time.perf_counter()
try:
    with run_lock(Path(sys.argv[1])):
        print("locked", flush=True)
        sys.stdin.readline()
except RunLockedError as exc:
    print(f"{time.perf_counter() - start:.3f} {exc}")
    sys.exit(3)
"""


def take_lock(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TAKE_LOCK, str(root)], input="\n", capture_output=True,
                          text=True, timeout=60)


def test_a_second_run_in_another_process_fails_at_once(tmp_path: Path) -> None:
    lock = tmp_path / ".conveyor" / "run.lock"
    with run_lock(tmp_path):
        done = take_lock(tmp_path)
        assert lock.read_text() == str(os.getpid())
    assert done.returncode == 3, done.stderr
    elapsed, _, message = done.stdout.strip().partition(" ")
    assert float(elapsed) < 1.0
    assert message == (f"another conveyor run holds {lock} (pid {os.getpid()}); wait for it to finish, "
                       "then run again")


def test_this_process_fails_at_once_while_another_holds_the_lock(tmp_path: Path) -> None:
    with holding(TAKE_LOCK, str(tmp_path), ready="locked") as holder:
        start = time.perf_counter()
        with pytest.raises(RunLockedError, match=rf"holds {tmp_path / '.conveyor' / 'run.lock'} "
                                                 rf"\(pid {holder.pid}\)"), run_lock(tmp_path):
            pass
        assert time.perf_counter() - start < 1.0
    with run_lock(tmp_path):  # released when the holder finished
        pass


def test_who_holds_the_lock_is_asked_without_taking_it(tmp_path: Path) -> None:
    """`status` during a run names the run's pid, also where it cannot open the lock to write."""
    assert run_holder(tmp_path) is None  # no state folder at all: nothing made
    assert not (tmp_path / ".conveyor").exists()
    with holding(TAKE_LOCK, str(tmp_path), ready="locked") as holder:
        assert run_holder(tmp_path) == holder.pid
        with pytest.raises(RunLockedError) as refused, run_lock(tmp_path):
            pass
        assert refused.value.pid == holder.pid
    assert run_holder(tmp_path) is None


def test_the_lock_is_released_after_a_run_and_after_a_failure(tmp_path: Path) -> None:
    with run_lock(tmp_path):
        pass
    assert take_lock(tmp_path).returncode == 0
    with pytest.raises(RuntimeError), run_lock(tmp_path):
        raise RuntimeError("stage failed")
    assert take_lock(tmp_path).returncode == 0
    assert (tmp_path / ".conveyor" / "run.lock").read_text() == ""


FORK_THEN_WAIT = """
import multiprocessing, sys, time
from pathlib import Path
from conveyor.workspace import run_lock
with run_lock(Path(sys.argv[1])):
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))  # a task's fork
    child.start()
    print(child.pid, flush=True)
    sys.stdin.readline()
"""


def test_a_fork_of_the_run_does_not_keep_the_lock_once_the_run_is_killed(tmp_path: Path) -> None:
    """A flock belongs to the open file, which a fork's copy of the descriptor keeps open: a task's
    multiprocessing child that outlived its run killed by kill -9 locked the project out for as long
    as it lived ("a run is in progress"), and the next command could not settle the run or end it."""
    with subprocess.Popen([sys.executable, "-c", FORK_THEN_WAIT, str(tmp_path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as run:
        assert run.stdout is not None
        child = int(run.stdout.readline())
        try:
            assert run_holder(tmp_path) == run.pid
            run.kill()
            run.wait(10)
            os.kill(child, 0)  # the fork lives on
            assert run_holder(tmp_path) is None
            with run_lock(tmp_path):
                pass
        finally:
            os.kill(child, signal.SIGKILL)
