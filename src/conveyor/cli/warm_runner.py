"""The warm runner: imports Prefect, DVC and conveyor's commands once, then forks a child per run.

Started by :func:`conveyor.cli.warm.spawn` as ``python -c ... KEY PATH FD`` in a session of its
own, from ``/``, by a run that found no runner. It claims its abstract socket name and listens
first, then closes the pipe ``FD`` (that run connects now), imports (:data:`PRELOAD`) and then
serves: the runs that connected meanwhile, that first one included, waited in the listening
queue. Each connection from a process of the same
user brings a command line, a working directory, an environment, a umask and three descriptors;
a forked child takes them as its own (:func:`_become`), keeps the conveyor modules the runner
had imported only if their files are unchanged (else it imports conveyor's code as it is on disk
now) and runs the command; the runner sends the child's pid and then its wait status back.

It forks only from a single thread (checked after the imports): nothing is locked in a child.
It also learns the data libraries its runs load (:data:`LEARNABLE`: NumPy, pandas, pyarrow, Dask's
dataframe, distributed, SciPy, scikit-learn, XGBoost, PyTorch; 0.1 to 1.3 CPU-s each): each child
says, as it exits, which of them it had imported, and the runner imports those before it forks the
next ``run`` or ``exec`` (not a ``status``), so that each is imported once, by a run that would
have imported it anyway (it waits for them, and may go meanwhile, as while a runner starts). Of
these only native threads start (OpenBLAS's pool, jemalloc's purger in pyarrow), which their
libraries stop or forget across a fork, and no OpenMP pool (the runner runs no parallel region);
no user code is ever imported here.
A child dies with the runner (``PR_SET_PDEATHSIG``) and is killed when its client goes (kill
-9 of ``conveyor``): the runner sees the connection close. The runner ends when no child has
run for its idle time (``CONVEYOR_WARM_IDLE``, else ``CONVEYOR_SERVER_IDLE``), on SIGTERM once
its children have ended (``conveyor server stop``: runs under way finish), and when more than
:data:`MAX_RUNNERS` runners of one ``PREFECT_HOME`` are up (the one used least recently goes). Its files, in
``PREFECT_HOME/conveyor-server/warm/``: ``KEY.json`` (pid, start, idle time, runs served: -1
while it imports, the libraries it learned; rewritten at each run) and ``KEY.log`` (its standard
error), both removed as it ends (the log kept where it holds something), unless a runner of the same
key has started meanwhile (:func:`_leave_files`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

from conveyor.cli.warm import COMMANDS, EVENT, HEADER, READY, address, idle_s
from conveyor.cli.warm_child import LEARNABLE, REPORT, SETTINGS_READ, child, origin, record_imported, settings_sources
from conveyor.cli.warm_state import directory, runners

MAX_RUNNERS = 4
STARTING = -1  # the runs served, in a state file, before the runner serves any
CHECK_EVERY_S = 1.0
REQUEST_TIMEOUT_S = 5.0
# conveyor's commands (and what they import as they load), then what a run imports on its way
PRELOAD = ("conveyor.cli.app", "conveyor.cli.run", "conveyor.prefect.flow", "conveyor.prefect.server",
           "conveyor.dvc.record", "conveyor.spec.dvcload", "prefect.main", "prefect.flow_engine",
           "prefect.task_engine", "prefect.task_runners", "prefect.logging.handlers",
           "prefect.utilities.visualization", "anyio._backends._asyncio", "dvc.repo.reproduce", "dvc.lock",
           "dvc.stage.cache", "dvc.scm", "dvc.repo.index", "dvc.repo.graph", "dvc.repo.plots", "dvc.repo.params",
           "dvc.repo.metrics", "dvc.repo.artifacts", "dvc.repo.datasets", "dvc.repo.stage", "dvc.repo.trie",
           "dvc.cachemgr", "dvc.data_cloud", "dvc.dirs", "dvc.rwlock", "dvc.dvcfile", "dvc.utils.strictyaml",
           "dvc_data.hashfile.db.local", "dvc_data.hashfile.status", "dvc_data.hashfile._progress",
           "dulwich.index", "dulwich.ignore", "dulwich.worktree", "configobj", "platformdirs", "networkx",
           "graphviz", "ruamel.yaml", "fsspec.implementations.memory", "rich._emoji_codes", "encodings.idna")


def serve(runner_key: str, ready_fd: int, *, task: bool = False) -> None:
    """The runner's life (see the module's doc); returns when it ends. ``task``: a runner of deterministic
    tasks (:mod:`conveyor.cli.warm_task`), which imports what a task needs, not Prefect and DVC."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(runner_key))
        listener.listen(16)  # the runs that come while it imports wait in this queue
    except OSError:  # another runner has this key
        return
    idle = idle_s()
    if idle is None:
        return
    state = directory() / f"{runner_key}.json"
    try:
        state.parent.mkdir(parents=True, exist_ok=True)
        log = os.open(state.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 2)
        os.close(log)
        _write_state(state, time.time(), idle, STARTING)  # listed (and stopped) from now on
    except OSError:
        return  # no place for its state: not visible, so not kept
    signal.signal(signal.SIGTERM, _leave)
    try:
        os.close(ready_fd)  # the run that started this one hands itself over now
        _preload(task)
        if _LEAVING:  # stopped while importing, and a library's bare `except:` took the SystemExit
            return
        if threading.active_count() > 1:  # a fork would copy held locks: serve nothing (the runs waiting
            # in the queue find their connections closed, and run by themselves)
            print(f"conveyor warm runner: threads after the imports ({threading.enumerate()}): not serving",
                  file=sys.stderr)
            return
        started = time.time()
        _write_state(state, started, idle, 0)
        for extra in runners()[MAX_RUNNERS:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(extra.pid, signal.SIGTERM)
        _Loop(listener, idle, state, started).run()
    finally:
        listener.close()
        _leave_files(runner_key, state)


def _leave_files(runner_key: str, state: Path) -> None:
    """At the runner's end: its state file, and its log where it holds nothing, unless a runner of the same
    key has started since this one stopped listening (``conveyor server stop`` while its runs went on, then a
    run): the files at those paths are that runner's now. The key's name, held while they go, says which."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(address(runner_key))
    except OSError:
        probe.close()
        return
    try:
        with contextlib.suppress(OSError):
            state.unlink()
        log = state.with_suffix(".log")
        with contextlib.suppress(OSError):
            if log.stat().st_size == 0:  # one per key otherwise, left for good: keys change with each install
                log.unlink()
        for other in state.parent.glob("*.log"):  # empty ones that runners of other keys left before they did this
            with contextlib.suppress(OSError):
                found = other.stat()
                stale = found.st_size == 0 and time.time() - found.st_mtime > STALE_LOG_S
                if stale and not other.with_suffix(".json").exists():
                    other.unlink()
    finally:
        probe.close()


_LEAVING: list[int] = []  # the SIGTERM received before the runner serves
STALE_LOG_S = 86_400.0  # an empty log of no runner, a day old: gone at the end of the next runner


def _leave(signum: int, frame: FrameType | None) -> None:
    """SIGTERM before the runner serves: it ends at once (its state file removed on the way out), or
    right after its imports where one of them swallowed the exit (``conveyor server stop`` just after
    a first run found a runner serving for its whole idle time)."""
    _LEAVING.append(signum)
    raise SystemExit(0)


def _preload(task: bool) -> None:
    if not task:
        from conveyor.prefect.server import bounded_environ

        bounded_environ()  # as every run sets them, before Prefect reads its settings
    for name in ("conveyor.run.isolated", "conveyor.run.logs") if task else PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  # a library missing or broken: the child imports (and fails on) it itself
            traceback.print_exc()
    if task:
        record_imported()
        return
    try:  # the TLS context and the models every run's Prefect clients use, made once here
        from conveyor.prefect.forks import prepare

        prepare()
    except Exception:  # noqa: BLE001  # as an import above: each run makes its own
        traceback.print_exc()
    SETTINGS_READ[:] = [settings_sources(Path.cwd())]
    from conveyor.run.environment import provided

    for entry in sys.path:  # which distribution provides which package: each run's record names them
        if entry and os.path.isdir(entry):
            provided(Path(entry))
    record_imported()


def _write_state(state: Path, started: float, idle: float, served: int, learned: list[str] | None = None) -> None:
    """``KEY.json``, replaced whole (a reader never sees half of it)."""
    part = state.with_suffix(".part")
    part.write_text(json.dumps({"pid": os.getpid(), "started": started, "idle_s": idle, "served": served,
                                "learned": learned or []}), encoding="utf-8")
    part.replace(state)


class _Loop:
    def __init__(self, listener: socket.socket, idle: float, state: Path, started: float) -> None:
        self.listener: socket.socket | None = listener
        self.idle, self.state = idle, state
        self.started, self.served = started, 0
        self.children: dict[int, socket.socket] = {}
        self.stopping = bool(_LEAVING)
        self.last = time.monotonic()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        self.wake_w = wake_w
        # what the children say they imported of LEARNABLE (a line each, written as they exit)
        self.report_r, report_w = os.pipe()
        os.set_blocking(self.report_r, False)
        os.set_blocking(report_w, False)  # a child never waits on it: a report that does not fit is dropped
        REPORT[:] = [report_w]
        self.to_learn: dict[str, str] = {}  # module -> the file the run imported it from
        self.learned: list[str] = []  # imported here (in the state file)
        self.failed: list[str] = []  # whose import failed here: not tried again
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, _nothing)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._stop)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> None:
        while True:
            self._reap()
            if self.stopping and self.listener is not None:
                self.listener.close()  # new runs find no runner and run by themselves
                self.listener = None
                with contextlib.suppress(OSError):
                    self.state.unlink()
            if not self.children and (self.stopping or time.monotonic() - self.last > self.idle):
                return
            waiting: list[Any] = [self.wake_r, self.report_r, *self.children.values(),
                                  *([self.listener] if self.listener else [])]
            ready, _, _ = select.select(waiting, [], [], CHECK_EVERY_S)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            if self.report_r in ready:
                self._read_reports()
            for pid, conn in list(self.children.items()):
                if conn in ready and not _recv(conn, 1):  # its client is gone (even by kill -9): so is the run
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if self.listener is not None and self.listener in ready:
                self._accept(self.listener)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.last = time.monotonic()
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(EVENT.pack(b"X", status))
                conn.close()

    def _read_reports(self) -> None:
        """The children's lines: the :data:`LEARNABLE` modules each had imported, and their files."""
        data = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.report_r, 65536):
                data += chunk
        for line in data.decode(errors="replace").splitlines():
            try:
                found = json.loads(line)
            except ValueError:
                continue
            for name, path in found.items() if isinstance(found, dict) else ():
                if name in LEARNABLE and isinstance(path, str) and name not in self.learned + self.failed:
                    self.to_learn.setdefault(name, path)

    def _learn(self) -> bool:
        """Import what the runs have been importing (:meth:`_read_reports`), before the next is forked:
        whether this runner may still fork (a library that started a Python thread would make it
        unsafe: the runner then serves no more, and the runs after it start runners of their own)."""
        self._read_reports()
        if not self.to_learn:
            return True
        others: list[str] = []  # not the modules the runs imported
        for name in sorted(self.to_learn, key=LEARNABLE.index):
            if any(name.startswith(f"{failed}.") for failed in self.failed):
                self.failed.append(name)  # its package was not learned: nor is it (finding it would import that)
                continue
            if any(name.startswith(f"{other}.") for other in others):
                continue  # finding it would import its package, the library the run did not import
            try:
                if origin(name) != os.path.realpath(self.to_learn[name]):
                    # the project's own, first on the run's sys.path: not the library now (another project's
                    # runs may teach it; this one's then start anew, conveyor.cli.warm_child)
                    others.append(name)
                    continue
                importlib.import_module(name)
                self.learned.append(name)
            except Exception:  # noqa: BLE001  # broken: each child imports (and fails on) it itself, as now
                traceback.print_exc()
                self.failed.append(name)
        self.to_learn.clear()
        if threading.active_count() > 1:
            print(f"conveyor warm runner: threads after importing {', '.join(self.learned)} "
                  f"({threading.enumerate()}): not serving", file=sys.stderr)
            self.stopping = True
            return False
        return True

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if peer[1] != os.getuid():
                raise OSError("another user")
            conn.sendall(READY)
            data, ancillary, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_SPACE(3 * 4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) - len(payload) % 4])
            data += _recv_exactly(conn, HEADER.size - len(data))
            request = json.loads(_recv_exactly(conn, HEADER.unpack(data)[0]))
            if len(fds) != 3:
                raise OSError("the three standard descriptors were not passed")
            argv = request.get("argv") or []
            if len(argv) > 1 and argv[1] in COMMANDS and not self._learn():  # not for `status` and the like
                raise OSError("no longer forking")
            if _gone(conn):  # it stopped waiting while this runner imported (Ctrl-C): nothing to run
                raise OSError("the client has gone")
        except (OSError, ValueError, struct.error):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        conn.settimeout(None)
        runner = os.getpid()
        pid = os.fork()
        if pid == 0:
            child(runner, peer[0], conn, fds, request,
                  [self.wake_r, self.wake_w, self.report_r, listener, *self.children.values()])
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.last = time.monotonic()
        self.served += 1
        with contextlib.suppress(OSError):
            _write_state(self.state, self.started, self.idle, self.served, self.learned)
        try:
            conn.sendall(EVENT.pack(b"P", pid))
        except OSError:
            os.kill(pid, signal.SIGKILL)


def _nothing(signum: int, frame: FrameType | None) -> None:
    """SIGCHLD: only to wake the loop (through the wakeup descriptor)."""


def _gone(conn: socket.socket) -> bool:
    """Whether the client closed its end (it sends nothing after its request: readable means closed)."""
    ready, _, _ = select.select([conn], [], [], 0)
    try:
        return bool(ready) and not conn.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def _recv(conn: socket.socket, size: int) -> bytes:
    try:
        return conn.recv(size)
    except OSError:
        return b""


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise OSError("the client went before its request was whole")
        data += chunk
    return data
