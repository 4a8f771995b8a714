"""Stopping the servers and clusters that tests start as their own process groups."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


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
