"""Which Prefect API a run records its flow run in: the one configured, else a local server.

With ``PREFECT_API_URL`` configured (a ``prefect server start`` a team keeps, Prefect
Cloud), runs go there and pay nothing for a server. Without one, Prefect would start its
own temporary server inside the flow call, after the runner has spent its time importing
Prefect, and would leave it behind on kill -9. conveyor starts a local one itself instead
(Prefect's ephemeral app under uvicorn, on a free loopback port, with the UI and background
services off) *before* importing Prefect, so the two take their seconds side by side on two
cores. By default that server is kept for the runs that follow (:mod:`conveyor.prefect.kept`:
visible, shared, gone after an idle time); with ``CONVEYOR_SERVER_IDLE=0`` it is the run's own
(:class:`TemporaryServer`), tied to the runner: it leaves with the run, also when the runner is
killed (the kernel's parent-death signal), and Ctrl-C in the terminal reaches the runner, which
stops it after Prefect's log and event workers have drained. Both keep their database under
``PREFECT_HOME``, as Prefect's own does, so past runs show in a ``prefect server start`` later.

Either server belongs to the run only as its observer: one that does not answer at the start
stops the run before anything runs (:func:`check_answers`), one that stops answering mid-run
costs no stage (:func:`lost_while_running`), and Prefect's client is bounded in this process
(:func:`bound_client`) so that neither holds the runner for minutes.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.errors import PrefectServerError, PrefectServerGone
from conveyor.run.nanny_env import user_environ

if TYPE_CHECKING:
    from prefect.settings import Settings

    from conveyor.prefect.kept import KeptServer

STARTUP_TIMEOUT_S = 120.0
# The URL of the local server (kept or temporary) while a run uses it: it has no UI to link to.
TEMPORARY: list[str] = []
# The URLs of servers that stopped answering during this process: nothing is left to send them,
# so the process ends without Prefect's drain at exit (which would wait on them for minutes).
LOST: list[str] = []

# Prefect's client waits 60 s for an answer and retries 5 times (2 + 4 + ... + 32 s): a server that
# died or hangs held a finished run for minutes. Bounded in the runner's process only (the user's
# profile is left alone), unless the environment sets them.
BOUNDED_CLIENT = {"PREFECT_API_REQUEST_TIMEOUT": "10", "PREFECT_CLIENT_MAX_RETRIES": "1"}
PROBE_TIMEOUT_S = 5.0  # for a server to answer /health before a run starts
DRAIN_TIMEOUT_S = 10.0  # for Prefect's log and event workers to send what they hold, each

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
_PROXIED = urllib.request.build_opener()  # elsewhere: through the proxies of the environment, as Prefect's client
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def unanswered(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Prefect API at ``url`` does not answer ``/health`` within ``timeout_s``; None when it
    answers. Any HTTP answer but 404 counts (one that asks for credentials is there: Prefect says the rest)."""
    opener = _DIRECT if urllib.parse.urlsplit(url).hostname in _LOOPBACK else _PROXIED
    try:
        with opener.open(f"{url.rstrip('/')}/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:  # 404: something else answers there (a URL without its /api)
        return "HTTP 404 at /health: no Prefect API there, whose URL ends in /api" if exc.code == 404 else None
    except (OSError, http.client.HTTPException) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"no answer within {timeout_s:g} s"
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        return str(reason) or type(reason).__name__


def check_answers(url: str) -> None:
    """A run records in the server at ``url``: it must answer before anything starts."""
    why = unanswered(url)
    if why is not None:
        raise PrefectServerGone(url, why)


@contextmanager
def lost_while_running(url: str, recorded_in: str) -> Iterator[None]:
    """Prefect's error, in the block, from a server at ``url`` that stopped answering becomes
    :class:`PrefectServerGone` (its one line instead of Prefect's traceback); any other error
    stays what it is. ``recorded_in``: where the run's stages are recorded, for that line."""
    try:
        yield
    except Exception as exc:
        why = unanswered(url)
        if why is None:
            raise
        LOST.append(url)
        raise PrefectServerGone(url, why, while_running=True, recorded_in=recorded_in) from exc


def raise_if_gone() -> None:
    """Inside a flow run: :class:`PrefectServerGone` now if its server stopped answering, rather
    than once each call still to make (artifacts, states) has waited out the client's retries."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    why = unanswered(url) if url else None
    if url and why is not None:
        LOST.append(url)
        raise PrefectServerGone(url, why, while_running=True)


def bounded_environ() -> bool:
    """:data:`BOUNDED_CLIENT` in the environment where it does not set them: whether any was added
    (Prefect's settings, if already read, are then out of date)."""
    added = [name for name in BOUNDED_CLIENT if name not in os.environ]
    os.environ.update({name: BOUNDED_CLIENT[name] for name in added})
    return bool(added)


def bound_client() -> None:
    """Bounded request timeouts and retries for Prefect's client in this process (see BOUNDED_CLIENT)."""
    if bounded_environ() and "prefect.settings" in sys.modules:  # imported already: its settings are read again
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


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


def _drain_prefect(url: str) -> None:
    """Send what Prefect's log and event workers still hold, while the server is up. When a worker
    has not sent it all within :data:`DRAIN_TIMEOUT_S` and the server no longer answers, the
    server is lost: the process ends without waiting on it again at exit (for minutes)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    if url in LOST:
        return
    for worker in (APILogWorker, EventsWorker):
        drained: object = None
        with contextlib.suppress(Exception):  # losing a late log line must not fail a finished run
            drained = worker.drain_all(timeout=DRAIN_TIMEOUT_S)
        if isinstance(drained, tuple) and drained[1] and unanswered(url) is not None:  # (done, not done)
            LOST.append(url)
            return


def lost() -> bool:
    """Whether a server this process recorded in stopped answering (its exit must not wait on it)."""
    return bool(LOST)


@contextmanager
def _draining(url: str) -> Iterator[str]:
    """``url``, and Prefect's workers drained (bounded) when the block ends, rather than at exit."""
    try:
        yield url
    finally:
        _drain_prefect(url)


@contextmanager
def prefect_api(log: Path, preload: str = "conveyor.prefect.flow") -> Iterator[str]:
    """The Prefect API URL this run records in, for the duration of the block.

    ``log``: where a temporary server writes. ``preload``: the module to import while the
    server starts (the Prefect door, which imports Prefect).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    bound_client()
    if os.environ.get("PREFECT_API_URL"):
        check_answers(os.environ["PREFECT_API_URL"])  # before the seconds of importing Prefect
        importlib.import_module(preload)
        with _draining(os.environ["PREFECT_API_URL"]) as url:
            yield url
        return
    from conveyor.prefect.kept import KeptServer, idle_s

    idle = idle_s()
    kept = KeptServer.of_home(idle) if idle else None
    if kept is not None and not kept.other_version():
        with _kept_api(kept, preload) as url:
            yield url
        return
    server = TemporaryServer(log)
    if not _may_be_configured(Path.cwd()):
        server.start()  # before Prefect is imported: the two proceed side by side
    try:
        configured = _settings_url(preload)
        if configured:  # a profile or settings file names a server: use it, ours is not needed
            server.stop()
            with _answering(configured) as url:
                yield url
            return
        if server.process is None:
            server.start()
        server.wait()
        with _recording_in(server.api_url):
            yield server.api_url
    finally:
        server.stop()


def _for_local_server(settings: Settings, url: str) -> Settings:
    """``settings`` (those in force) for a run on the local server at ``url``: no flow run heartbeats
    and no UI URL (see :func:`_recording_in`), and no version handshake: the server is this Prefect's
    (a kept server of another version is not joined), so its clients need not ask for its API
    version (2 of a two-stage run's 16 requests; with them, the run and the server took 0.04 CPU-s
    more of their 0.46). CSRF tokens are still asked for: a kept server started where its CSRF
    protection was turned on refuses every client without them.

    A copy of the settings with those fields replaced, not Prefect's ``copy_with_update``, which
    validates the whole tree anew and so reads every settings source again for each of Prefect's
    nested settings models (30 ms of every run). Only the server UI's API URL, which Prefect derives
    from the API's, is not derived again: a client's settings, and the local server has no UI."""
    return settings.model_copy(update={
        "api": settings.api.model_copy(update={"url": url}),
        "client": settings.client.model_copy(update={"server_version_check_enabled": False}),
        "flows": settings.flows.model_copy(update={"heartbeat_frequency": None}),
        "ui_url": ""})


def _settings_url(preload: str) -> str | None:
    """Import ``preload`` (the Prefect door); the API URL a Prefect profile or settings file names, if any."""
    importlib.import_module(preload)
    from prefect.settings import PREFECT_API_URL

    configured = PREFECT_API_URL.value()
    return str(configured) if configured else None


@contextmanager
def _answering(url: str) -> Iterator[str]:
    """``url``, once it answers, drained at the end of the block (a server the user configured)."""
    check_answers(url)
    with _draining(url) as used:
        yield used


@contextmanager
def _kept_api(kept: KeptServer, preload: str) -> Iterator[str]:
    """The kept server's URL (joined, else started while Prefect is imported), leased for the block."""
    try:
        url = kept.join()
        if url is None and not _may_be_configured(Path.cwd()):
            kept.launch()  # before Prefect is imported: the two proceed side by side
    except OSError as exc:
        kept.cancel()
        raise PrefectServerError(f"cannot keep a Prefect server in {kept.directory}: {exc.strerror or exc} (set "
                                 "PREFECT_HOME to a folder you can write, or PREFECT_API_URL to a server you run)"
                                 ) from None
    try:
        configured = _settings_url(preload)
        if configured:  # a profile or settings file names a server: use it, ours is not needed
            kept.cancel()
            with _answering(configured) as used:
                yield used
            return
        if url is None:
            if kept.process is None and kept.lease is None:
                kept.launch()
            url = kept.ready()
        with _recording_in(url):
            yield url
    finally:
        kept.leave()


@contextmanager
def _recording_in(url: str) -> Iterator[None]:
    """Prefect's client of this process sends to the local server at ``url`` during the block.

    Without flow run heartbeats: they feed the zombie-run automations of a server with services,
    which a local server does not run, and Prefect's heartbeat thread sleeps in steps of a second
    that the end of every flow run waits out (0.5 s on average, a third of a one-stage run). And
    without a UI URL: the local server serves no UI, so Prefect's "View at ..." would be a dead link.
    """
    import prefect.context

    for name in ("NO_PROXY", "no_proxy"):  # Prefect's client must reach the loopback server directly
        os.environ[name] = ",".join(filter(None, [os.environ.get(name), "127.0.0.1"]))
    before = prefect.context.GLOBAL_SETTINGS_CONTEXT
    os.environ["PREFECT_API_URL"] = url  # for the processes the run starts (a Dask worker's client)
    settings = _for_local_server(before.settings, url)  # for every thread
    prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.SettingsContext(profile=before.profile, settings=settings)
    TEMPORARY.append(url)
    try:
        yield
    finally:
        _drain_prefect(url)
        TEMPORARY.remove(url)
        os.environ.pop("PREFECT_API_URL", None)
        # the settings of the environment as it is again: those from before (rebuilding them reads
        # every settings source anew, 50 ms of a one-stage run)
        prefect.context.GLOBAL_SETTINGS_CONTEXT = before
