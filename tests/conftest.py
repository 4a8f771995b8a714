"""Session-wide real components: one Prefect server for the whole test session.

Starting Prefect's server costs seconds (SQLite migrations), so every test that runs a
flow shares this one, on a free loopback port with a temporary PREFECT_HOME.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from subprocs import stop_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.25)  # a server that is booting: nothing to wait on but the socket
    raise RuntimeError(f"prefect server at {url} not healthy after {deadline_s}s")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server start` on 127.0.0.1; yields the env that points clients at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_API_URL": ""}
    env.pop("PREFECT_API_URL")
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_healthy(url, proc, 120)
        yield {"PREFECT_HOME": str(home), "PREFECT_API_URL": url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    finally:
        stop_group(proc, timeout=30)
        log.close()


REPO = Path(__file__).resolve().parents[1]
