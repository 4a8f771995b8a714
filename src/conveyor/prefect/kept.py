"""The Prefect server conveyor keeps between runs, when no ``PREFECT_API_URL`` is configured.

A run without a configured server used to start Prefect's temporary server and stop it at its
end: 4 to 6 seconds of every run, when the stage forced may take a tenth of that. The first run
now starts one that stays (:mod:`conveyor.prefect.keeper`), and every later run of the same
``PREFECT_HOME`` (the database it serves) records its flow run there without waiting. It is:

- visible: ``conveyor server status`` and ``conveyor runs`` show it (URL, pid, the runs using it);
  ``conveyor server stop`` ends it;
- bounded: loopback only, one per ``PREFECT_HOME``, gone :data:`DEFAULT_IDLE_S` seconds after the
  last run using it ended (``CONVEYOR_SERVER_IDLE``; 0 gives the old server per run), also when
  that run was killed: a run's lease is a ``flock`` the kernel drops with the process;
- shared safely: two projects and two concurrent runs use one server (one uvicorn process, one
  SQLite database, as ``prefect server start``); starts are serialised by ``start.lock``.

Its files live in ``PREFECT_HOME/conveyor-server/``: ``server.json`` (pid, port, Prefect's
version), ``server.log``, ``gate``, ``start.lock`` and ``leases/``. A server of another Prefect
version is not shared (its database schema may differ): that run starts its own temporary one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from io import TextIOWrapper
from pathlib import Path

from conveyor.errors import PrefectServerError, UsageError
from conveyor.run.leftovers import outliving
from conveyor.run.nanny_env import user_environ
from conveyor.workspace import command_pid

DEFAULT_IDLE_S = 900.0
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def idle_s() -> float:
    """How long a kept server waits unused before it stops (``CONVEYOR_SERVER_IDLE``, seconds; 0: a
    server per run, stopped with it)."""
    raw = os.environ.get("CONVEYOR_SERVER_IDLE", "").strip()
    if not raw:
        return DEFAULT_IDLE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < 10**7:
        raise UsageError(f"CONVEYOR_SERVER_IDLE={raw!r}: give the seconds a kept Prefect server waits unused "
                         "before it stops (0: a server per run)")
    return value


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def _prefect_version() -> str:
    from importlib.metadata import version

    return version("prefect")


@dataclass(frozen=True)
class State:
    """What ``server.json`` says of a kept server."""

    pid: int
    url: str
    idle_s: float
    started: float
    prefect: str

    @classmethod
    def read(cls, directory: Path) -> State | None:
        try:
            raw = json.loads((directory / "server.json").read_text(encoding="utf-8"))
            return cls(int(raw["pid"]), str(raw["url"]), float(raw["idle_s"]), float(raw["started"]),
                       str(raw["prefect"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def alive(self) -> bool:
        """Its process still runs, and is a keeper (not a pid reused since)."""
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return b"conveyor.prefect.keeper" in f.read()
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: the signal tells whether the pid lives
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True


class _Lock:
    """A flock on a file of the server's directory; ``timeout_s``: how long to wait for it (None:
    as long as it takes, for locks only held for an instant)."""

    def __init__(self, path: Path, mode: int, timeout_s: float | None = None) -> None:
        self.path, self.mode, self.timeout_s = path, mode, timeout_s
        self.file: TextIOWrapper | None = None

    def __enter__(self) -> _Lock:
        self.file = self.path.open("a")
        if self.timeout_s is None:
            fcntl.flock(self.file, self.mode)
            return self
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.file, self.mode | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.file.close()
                    raise PrefectServerError(
                        f"another run has been starting the Prefect server conveyor keeps for {self.timeout_s:.0f} s "
                        f"({self.path} is locked): wait for it, or set PREFECT_API_URL to a server you run") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        assert self.file is not None
        self.file.close()  # closing lets go of the lock


class KeptServer:
    """The kept server of ``directory`` (``PREFECT_HOME/conveyor-server``), seen from one run:
    :meth:`join` one that runs, or :meth:`launch` one and wait until it is :meth:`ready`; the run
    holds its lease until :meth:`leave`."""

    def __init__(self, directory: Path, idle: float) -> None:
        self.directory = directory
        self.idle = idle
        self.lease: TextIOWrapper | None = None
        self.lease_path: Path | None = None
        self.starting: _Lock | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.log = directory / "server.log"
        self.url = ""  # of the server joined

    @classmethod
    def of_home(cls, idle: float) -> KeptServer:
        return cls(prefect_home() / "conveyor-server", idle)

    def join(self) -> str | None:
        """The URL of the kept server, leased to this run (it stays while the run lasts); None when
        there is none, or one of another Prefect version (not shared)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "leases").mkdir(exist_ok=True)
        with _Lock(self.directory / "gate", fcntl.LOCK_SH):  # the server cannot close while we read it
            state = State.read(self.directory)
            if state is None or not state.alive() or state.prefect != _prefect_version():
                return None
            self.lease_path = self.directory / "leases" / f"{command_pid()}-{time.monotonic_ns()}"
            self.lease = self.lease_path.open("w")
            fcntl.flock(self.lease, fcntl.LOCK_EX)
        from conveyor.prefect.server import unanswered

        if unanswered(state.url) is not None:  # alive but wedged: not ours to use
            self.leave()
            return None
        self.url = state.url
        return state.url

    def other_version(self) -> bool:
        """A live kept server of another Prefect version holds this PREFECT_HOME."""
        state = State.read(self.directory)
        return state is not None and state.alive() and state.prefect != _prefect_version()

    def launch(self) -> None:
        """Start a kept server, unless one started while this run waited its turn (then joined)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.starting = _Lock(self.directory / "start.lock", fcntl.LOCK_EX, STARTUP_TIMEOUT_S + 10).__enter__()
        if self.join() is not None:
            return
        port = _free_port()
        env = outliving({**user_environ(), "PREFECT_UI_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "conveyor.prefect.keeper", str(self.directory), str(port), f"{self.idle:g}"],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=self.directory,
                start_new_session=True)  # it outlives this run: no signal of the terminal reaches it

    def ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """The URL of the server :meth:`launch` started (or found), once it answers, leased."""
        try:
            if self.lease is not None:  # launch() found one started meanwhile, and joined it
                return self.url
            assert self.process is not None
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise PrefectServerError(f"the Prefect server conveyor keeps exited with code {code} before it "
                                             f"answered; its output is in {self.log}")
                state = State.read(self.directory)
                if state is not None and state.pid == self.process.pid and self.join() is not None:
                    return state.url
                time.sleep(0.05)
            self.process.kill()
            raise PrefectServerError(f"the Prefect server conveyor keeps did not answer within {timeout_s:.0f} s; "
                                     f"its output is in {self.log} (or set PREFECT_API_URL to a server you run)")
        finally:
            self._started()

    def cancel(self) -> None:
        """Not needed after all (a settings file names a server): stop what :meth:`launch` started."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        self._started()
        self.leave()

    def _started(self) -> None:
        if self.starting is not None:
            self.starting.__exit__()
            self.starting = None

    def leave(self) -> None:
        """Let go of this run's lease: the server's idle time starts when the last run left."""
        if self.lease is not None:
            assert self.lease_path is not None
            with contextlib.suppress(OSError):
                self.lease_path.unlink()
            self.lease.close()
            self.lease = self.lease_path = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Seen:
    """A kept server as ``conveyor server status`` shows it."""

    state: State
    runs: list[int]  # pids of the runs using it


def seen(directory: Path) -> Seen | None:
    """The kept server of ``directory`` and the runs using it; None when none runs."""
    from conveyor.prefect.keeper import live_leases

    if not (directory / "gate").exists():
        return None
    with _Lock(directory / "gate", fcntl.LOCK_EX):
        state = State.read(directory)
        if state is None or not state.alive():
            return None
        return Seen(state, live_leases(directory))


def stop(directory: Path, force: bool) -> Seen | None:
    """Stop the kept server of ``directory`` (None when none ran). Refused while runs use it, unless
    ``force`` (those runs then fail for their server: their stages keep their outcome)."""
    from conveyor.prefect.keeper import live_leases, remove_state

    if not (directory / "gate").exists():
        return None
    with _Lock(directory / "gate", fcntl.LOCK_EX):
        state = State.read(directory)
        if state is None or not state.alive():
            return None
        runs = live_leases(directory)
        if runs and not force:
            raise UsageError(f"the kept Prefect server ({state.url}) is in use by {len(runs)} run(s) "
                             f"(pid {', '.join(map(str, runs))}): stop them first, or `conveyor server stop --force`")
        remove_state(directory, state.pid)  # no run joins it from here on
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while state.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if state.alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGKILL)
    return Seen(state, runs)
