"""Which Prefect API a run records its flow run in: the one configured, else a temporary server.

With ``PREFECT_API_URL`` configured (a ``prefect server start`` a team keeps, Prefect
Cloud), runs go there and pay nothing for a server. Without one, Prefect would start its
own temporary server inside the flow call, after the runner has spent its time importing
Prefect, and would leave it behind on kill -9. conveyor starts that same server itself
(Prefect's ephemeral app under uvicorn, on a free loopback port, with the UI and
background services off) *before* importing Prefect, so the two take their seconds side
by side on two cores, and ties it to the runner: it leaves with the run, also when the
runner is killed (the kernel's parent-death signal), and Ctrl-C in the terminal reaches
the runner, which stops it after Prefect's log and event workers have drained. Like
Prefect's own, it keeps its database under ``PREFECT_HOME``, so past runs show in a
``prefect server start`` later.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conveyor.errors import PrefectServerError
from conveyor.run.nanny_env import user_environ

STARTUP_TIMEOUT_S = 120.0
# The URL of the temporary server while a run uses it (it has no UI and ends with the run).
TEMPORARY: list[str] = []

# A parent-death signal, then uvicorn: set before exec, so the server dies with the runner
# even when the runner is killed with SIGKILL (PR_SET_PDEATHSIG = 1; it survives exec).
# SIGKILL, not SIGTERM: uvicorn defers SIGTERM until its startup ends, and a first start
# migrates a new database for seconds; SQLite's transactions (one per migration) make the
# kill safe, and the next server goes on from the last migration committed.
_LAUNCH = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", "uvicorn", *sys.argv[2:]])
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


class TemporaryServer:
    """Prefect's ephemeral API server in a subprocess of this run, on 127.0.0.1."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        """Launch it; returns at once (:meth:`wait` waits until it answers)."""
        self.port = _free_port()
        env = {**user_environ(), "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(os.getpid()), "--factory", "prefect.server.api.server:create_app",
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)  # Ctrl-C goes to the runner, which stops it in order

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until ``/health`` answers; a clear error naming its log when it exits or never answers."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrefectServerError(f"the temporary Prefect server exited with code {self.process.returncode} "
                                         f"before it answered; its output is in {self.log}")
            try:
                with _DIRECT.open(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise PrefectServerError(f"the temporary Prefect server did not answer within {timeout_s:.0f} s; its output "
                                 f"is in {self.log} (or set PREFECT_API_URL to a server you run)")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _may_be_configured(cwd: Path) -> bool:
    """Whether a Prefect settings file might set PREFECT_API_URL (then Prefect is asked first).

    A cheap look, without importing Prefect, at the places its settings come from besides
    the environment: the profiles file, and prefect.toml, .env and pyproject.toml here.
    """
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    files = [Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml"),
             cwd / "prefect.toml", cwd / ".env", cwd / "pyproject.toml"]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if "PREFECT_API_URL" in text or ("[api]" in text and path.name == "prefect.toml") \
                or "tool.prefect.api" in text or ("[tool.prefect" in text and "url" in text):
            return True
    return False


def _drain_prefect() -> None:
    """Send what Prefect's log and event workers still hold, while the server is up."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # losing a late log line must not fail a finished run
            worker.drain_all(timeout=10)


@contextmanager
def prefect_api(log: Path, preload: str = "conveyor.prefect.flow") -> Iterator[str]:
    """The Prefect API URL this run records in, for the duration of the block.

    ``log``: where a temporary server writes. ``preload``: the module to import while the
    server starts (the Prefect door, which imports Prefect).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_API_URL"):
        importlib.import_module(preload)
        yield os.environ["PREFECT_API_URL"]
        return
    server = TemporaryServer(log)
    if not _may_be_configured(Path.cwd()):
        server.start()  # before Prefect is imported: the two proceed side by side
    try:
        importlib.import_module(preload)
        from prefect.context import refresh_global_settings_context
        from prefect.settings import PREFECT_API_URL

        configured = PREFECT_API_URL.value()
        if configured:  # a profile or settings file names a server: use it, ours is not needed
            server.stop()
            yield str(configured)
            return
        if server.process is None:
            server.start()
        server.wait()
        for name in ("NO_PROXY", "no_proxy"):  # Prefect's client must reach the loopback server directly
            os.environ[name] = ",".join(filter(None, [os.environ.get(name), "127.0.0.1"]))
        os.environ["PREFECT_API_URL"] = server.api_url
        refresh_global_settings_context()
        TEMPORARY.append(server.api_url)
        try:
            yield server.api_url
        finally:
            _drain_prefect()
            TEMPORARY.remove(server.api_url)
            os.environ.pop("PREFECT_API_URL", None)
            refresh_global_settings_context()
    finally:
        server.stop()
