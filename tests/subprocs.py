"""Child processes of tests: servers and clusters in their own process groups, and holders.

A holder is a Python child that takes something (a lock, a journal entry), says so and keeps
it until the test lets go: how a test checks what another process sees meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psutil
import pytest

T = TypeVar("T")
# Set on a test's item when one of its phases failed (tests/conftest.py's pytest_runtest_makereport):
# what a fixture's teardown reads to clean up after a test that stopped half-way
FAILED = pytest.StashKey[bool]()


@contextmanager
def holding(script: str, *args: str, ready: str) -> Iterator[subprocess.Popen[str]]:
    """Run ``script`` (``python -c``) until it prints ``ready``; the block runs while it holds.

    On leaving the block, a line on its stdin tells it to let go, and it must exit 0;
    if the block raised, it is killed.
    """
    holder = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == ready
        yield holder
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def stop_group(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``);
    SIGKILL it if it has not exited within ``timeout`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def marked(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` in CONVEYOR_TEST_MARK (a test's own children)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("CONVEYOR_TEST_MARK") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until_none(tag: str, timeout: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := marked(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def is_warm_runner(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a warm runner (conveyor.cli.warm_runner) or a run it forked: both have its
    command line (a caller tells them apart by the parent)."""
    return "conveyor.cli.warm_runner" in " ".join(proc.cmdline())


def cmdline(proc: psutil.Process) -> list[str]:
    """``proc``'s command line, or none when it ended meanwhile: a process listed a moment ago (a
    stage's ``touch`` or ``sleep``) may be gone by the time its command line is read."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def wait_until(what: str, found: Callable[[], T], proc: subprocess.Popen[Any] | None = None, *,
               timeout_s: float = 120, every_s: float = 0.05) -> T:
    """Poll ``found`` until it returns something truthy, and return that; the test fails when
    ``timeout_s`` pass first or, given ``proc`` (a run), when it ends first (with the end of its
    output, where it writes to a pipe)."""
    deadline = time.monotonic() + timeout_s
    while not (result := found()):
        if proc is not None and proc.poll() is not None:
            output = proc.communicate()[0] if proc.stdout is not None else ""
            tail = output[-3000:] if isinstance(output, str) else (output or b"")[-3000:].decode(errors="replace")
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {tail}")
        assert time.monotonic() < deadline, f"never saw {what} within {timeout_s:g} s"
        time.sleep(every_s)
    return result


def wait_for(path: os.PathLike[str], proc: subprocess.Popen[Any], timeout_s: float = 120) -> None:
    """Wait for ``path`` to appear while ``proc`` (the run that makes it) lives: :func:`wait_until`."""
    wait_until(f"{os.fspath(path)} appear", lambda: os.path.exists(path), proc, timeout_s=timeout_s)
