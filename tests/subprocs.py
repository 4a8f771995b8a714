"""Child processes of tests: servers and clusters in their own process groups, and holders.

A holder is a Python child that takes something (a lock, a journal entry), says so and keeps
it until the test lets go: how a test checks what another process sees meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
