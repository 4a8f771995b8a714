"""A `prefect server start` for the benchmark's runs, so that Prefect's startup is not measured.

It runs on a free loopback port with a temporary PREFECT_HOME, in its own process group,
which is stopped (SIGTERM, then SIGKILL) when the benchmark ends, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from benchmarks.processes import stop_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrefectServer:
    """``with PrefectServer() as server: subprocess.run(..., env=server.env)``."""

    def __init__(self, startup_timeout_s: float = 180) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.home = Path(tempfile.mkdtemp(prefix="conveyor-bench-prefect-"))
        self.url = f"http://127.0.0.1:{free_port()}/api"
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment that points Prefect clients (``conveyor run``) at this server."""
        return {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def __enter__(self) -> PrefectServer:
        env = {**self.env, "PREFECT_SERVER_UI_ENABLED": "false"}
        env.pop("PREFECT_API_URL")
        started = time.monotonic()
        port = self.url.split(":")[-1].split("/")[0]
        with (self.home / "server.log").open("wb") as log:
            self._proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                           "--port", port], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        try:
            self._wait_healthy(self._proc, started + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _wait_healthy(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (self.home / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError(f"prefect server at {self.url} not healthy after {self.startup_timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the server's process group (SIGTERM, SIGKILL after ``timeout_s``) and remove its PREFECT_HOME."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
            stop_group(proc.pid, grace_s=0)  # what is left of its group, SIGKILLed
            proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)
