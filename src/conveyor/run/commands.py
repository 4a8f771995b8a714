"""``cmd`` stages: shell commands run in their own process group, here or on a Dask worker.

A command runs through ``/bin/sh`` (a dvc.yaml's: the shell ``dvc repro`` uses) under a
guard (:mod:`conveyor.run.guard`) that leads a new process group: a timeout, Ctrl-C or the
end of the run kills the whole group (the shell, and everything the command started), and
the guard kills it by itself when the process that started it dies, kill -9 included. Its
stdout and stderr are read line by line and handed to a sink (the stage's log file and the
live view); a non-zero exit fails the stage with the last lines of stderr.

On a Dask profile the same code runs inside a Dask task on one worker, where the guard is
the worker's child; lines travel back as Dask events (``Worker.log_event``) and a cancel
reaches the worker with ``Client.run``. There the command is held to the worker's
``memory_limit`` as the nanny holds a task (:mod:`conveyor.run.tree_memory`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from conveyor.errors import StageError, plain
from conveyor.run.guard import descendants, pidfd, signal_all
from conveyor.run.nanny_env import user_environ
from conveyor.run.tree_memory import CommandOverMemory, MemoryBudget, tree_rss, worker_budget

if TYPE_CHECKING:
    from distributed import Client, Future

    from conveyor.run.unshared import Shipment

GUARD = Path(__file__).with_name("guard.py")
TAIL_LINES = 20  # of stderr, shown when a command fails
KILL_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a command's group
LATE_LINES_S = 1.0  # how long a stage that failed on a worker waits for the lines sent as it failed
_POLL_S = 0.05  # how often a waiting stage thread looks up (Ctrl-C and timeouts land in between)
_MEMORY_POLL_S = 0.1  # how often a command's memory is measured: as often as Dask's nanny measures its worker

Sink = Callable[[str, str], None]  # (stream "out" | "err", line without its newline)


@dataclass(frozen=True)
class Command:
    """A ``cmd`` stage ready to run: its commands (interpolated), where, and for how long."""

    stage: str
    commands: tuple[str, ...]
    cwd: str  # absolute; a string, as it travels to Dask workers
    env: Mapping[str, str] = field(default_factory=dict)  # added to the environment it runs in
    timeout_s: float | None = None
    own_gpu: bool = False  # dask-cuda: only the worker's own GPU is visible to the command
    shell: tuple[str, ...] = ("/bin/sh", "-c")  # the argv before each command


@dataclass(frozen=True)
class Finished:
    """How a command ended: its exit status and the last lines it wrote to stderr."""

    returncode: int
    stderr_tail: tuple[str, ...]
    outs: Mapping[str, str] = field(default_factory=dict)  # run in a scratch directory: the outs' hashes in the remote


class CommandFailed(StageError):
    """A command exited with a non-zero status."""

    def __init__(self, stage: str, returncode: int, tail: Sequence[str]) -> None:
        shown = "\n".join(f"  {plain(line)}" for line in tail if plain(line).strip())  # no dangling heading
        signalled = f" (killed by signal {returncode - 128})" if returncode > 128 else ""
        reason = f"command exited with status {returncode}{signalled}" + (
            f"; last lines of stderr:\n{shown}" if shown else "; it wrote nothing to stderr")
        super().__init__(stage, reason)
        self.returncode, self.tail = returncode, tuple(tail)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles through Dask with its own arguments
        return (type(self), (self.stage, self.returncode, self.tail))


class CommandTimeout(StageError, TimeoutError):
    """A command ran past the stage's ``timeout_s``; its process group was killed."""

    def __init__(self, stage: str, timeout_s: float) -> None:
        super().__init__(stage, f"timed out after {timeout_s:g}s (timeout_s); its processes were killed")
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage, self.timeout_s))


# --------------------------------------------------------------------------- here


_RUNNING: dict[str, subprocess.Popen[bytes]] = {}  # token -> guard, for cancel_on_worker
_RUNNING_LOCK = threading.Lock()


def run_here(command: Command, sink: Sink, *, token: str | None = None, budget: MemoryBudget | None = None) -> Finished:
    """Run ``command`` in this process's tree; its whole process group is gone when this returns.

    Raises :class:`CommandTimeout` past ``timeout_s``, :class:`CommandOverMemory` once its
    processes hold more than ``budget`` allows. Any exception raised into the waiting
    thread (Ctrl-C, a stage timeout) kills the group, then propagates.
    """
    guard = _start(command)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    readers: list[threading.Thread] = []
    try:  # from here: an interrupt raised while the readers start (a thread's start waits) ends the group too
        if token is not None:
            with _RUNNING_LOCK:
                _RUNNING[token] = guard
        readers += [_reader(guard.stdout, "out", sink, None), _reader(guard.stderr, "err", sink, tail)]
        returncode = _wait(guard, command, budget)
    finally:
        kill_group(guard)
        for reader in readers:
            reader.join(timeout=KILL_GRACE_S)
        assert guard.stdin is not None
        guard.stdin.close()
        if token is not None:
            with _RUNNING_LOCK:
                _RUNNING.pop(token, None)
    return Finished(returncode, tuple(tail))


def _start(command: Command) -> subprocess.Popen[bytes]:
    env = {**user_environ(), **command.env}  # not os.environ: a Dask nanny in this process writes into it
    if command.own_gpu and env.get("CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"].split(",")[0]  # dask-cuda lists its own first
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(GUARD), str(len(command.shell)), *command.shell, *command.commands],
        cwd=command.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: signals from the terminal go to conveyor, not to it
    )


def _wait(guard: subprocess.Popen[bytes], command: Command, budget: MemoryBudget | None) -> int:
    """The guard's exit status, noticed the moment it exits (where Linux says so on a pidfd).

    In between, every ``_POLL_S`` at most, the deadline and an exception raised into this thread
    (Ctrl-C) have their turn, and the memory budget every ``_MEMORY_POLL_S``. ``Popen.wait`` with
    a timeout alone polls with sleeps that grow to 50 ms: each stage of a chain ended 25 ms late.
    """
    deadline = None if command.timeout_s is None else time.monotonic() + command.timeout_s
    measured = time.monotonic()
    with _exit_notice(guard.pid) as step:
        while True:
            try:
                return guard.wait(timeout=step(_POLL_S))
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    kill_group(guard, grace_s=KILL_GRACE_S)
                    raise CommandTimeout(command.stage, float(command.timeout_s or 0)) from None
                if budget is not None and now - measured >= _MEMORY_POLL_S:
                    measured = now
                    _check_memory(guard, command, budget)


@contextlib.contextmanager
def _exit_notice(pid: int) -> Iterator[Callable[[float], float]]:
    """``step(seconds)``: waits up to ``seconds`` for ``pid`` (a child not yet reaped) to exit and
    returns the timeout for the ``Popen.wait`` that follows: 0, the pidfd did the waiting. Without
    a pidfd (not Linux 5.3+, or refused) it returns ``seconds`` at once: ``Popen.wait`` waits."""
    fd = pidfd(pid)
    if fd is None:
        yield lambda seconds: seconds
        return
    exits = select.poll()  # not select.select: a long run's descriptors pass 1024
    exits.register(fd, select.POLLIN)  # readable once it has exited

    def step(seconds: float) -> float:
        exits.poll(seconds * 1000)
        return 0.0

    try:
        yield step
    finally:
        os.close(fd)


def _check_memory(guard: subprocess.Popen[bytes], command: Command, budget: MemoryBudget) -> None:
    """Kill the command's group at once (no grace: it may be taking the worker's memory fast)
    when its processes hold more than the budget."""
    used = tree_rss(guard.pid)
    if used > budget.threshold:
        kill_group(guard)
        raise CommandOverMemory(command.stage, used, budget.limit, budget.fraction)


def kill_group(guard: subprocess.Popen[bytes], *, grace_s: float = 0.0) -> None:
    """End every process of the command: SIGTERM first when given a grace, then SIGKILL.

    The group outlives its leader while any member lives, and its id is not reused while
    it exists, so this is safe after the guard itself has exited. What left the group under
    the guard (a daemon: see :mod:`conveyor.run.guard`) is listed before the guard is signalled,
    as it is orphaned the moment the guard dies, and signalled with it.
    """
    # only while the guard is unreaped is its pid its own (listed later, it could be anyone's)
    escaped = [pid for pid in descendants(guard.pid) if _group_of(pid) != guard.pid] if guard.poll() is None else []
    if grace_s > 0 and _signal_group(guard.pid, signal.SIGTERM):
        signal_all(escaped, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            guard.poll()  # reaped, the guard no longer counts as a member
            if not _signal_group(guard.pid, 0) and not any(_alive(pid) for pid in escaped):
                break
            time.sleep(0.05)
    _signal_group(guard.pid, signal.SIGKILL)
    signal_all(escaped, signal.SIGKILL)
    guard.wait()


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _reader(stream: IO[bytes] | None, name: str, sink: Sink, tail: collections.deque[str] | None) -> threading.Thread:
    def pump() -> None:
        assert stream is not None
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if tail is not None:
                    tail.append(line)
                try:
                    sink(name, line)
                except Exception:  # keep draining: a full pipe would block the command
                    logging.getLogger(__name__).exception("could not hand on a line of %s", name)

    thread = threading.Thread(target=pump, name=f"conveyor-{name}", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- on a Dask worker


def run_on_worker(client: Client, command: Command, sink: Sink, workers: Sequence[str] | None = None,
                  resources: Mapping[str, float] | None = None, shipment: Shipment | None = None) -> Finished:
    """Run ``command`` inside a Dask task on one of ``client``'s workers (of ``workers``, when given,
    asking Dask for ``resources``); its lines come to ``sink``. With a ``shipment``, the worker
    does not see the project: it runs in a scratch directory (:mod:`conveyor.run.unshared`).

    Interrupted (Ctrl-C, a stage timeout), the command's process group on the worker is
    killed before this returns.
    """
    token = uuid.uuid4().hex[:12]
    topic = f"conveyor-cmd-{token}"

    def stop(future: Future[Any]) -> None:
        client.run(cancel_on_worker, token, on_error="ignore")
        future.cancel()

    finished: Finished = followed(
        client, topic, sink, shipment,
        lambda: client.submit(on_worker, command, token, topic, shipment, key=f"conveyor-cmd-{command.stage}-{token}",
                              pure=False, retries=0, workers=list(workers) if workers else None,
                              allow_other_workers=False, resources=dict(resources) if resources else None),
        stop=stop)
    return finished


def followed(client: Client, topic: str, sink: Sink, shipment: Shipment | None, submit: Callable[[], Future[Any]],
             *, stop: Callable[[Future[Any]], None]) -> Any:
    """A stage's Dask task, submitted by ``submit`` and waited for: the lines it sends as events on
    ``topic`` go to ``sink`` (the saves of its checkpoint are fetched, :func:`conveyor.run.unshared.saves_fetched`);
    its result once its last lines are in. Left before it ends (Ctrl-C, a stage timeout): ``stop``."""
    from conveyor.run.unshared import saves_fetched

    ended = threading.Event()

    def receive(event: tuple[float, Any]) -> None:
        if event[1] is None:
            ended.set()
            return
        for stream, line in event[1]:
            sink(stream, line)

    with saves_fetched(shipment, sink) as sink:
        client.subscribe_topic(topic, receive)
        future = submit()
        done = threading.Event()
        future.add_done_callback(lambda _f: done.set())
        try:
            while not done.wait(_POLL_S):
                pass
            try:
                result = future.result()
            except BaseException:
                ended.wait(timeout=LATE_LINES_S)  # the last lines (and checkpoint) sent as it failed there
                raise
            ended.wait(timeout=KILL_GRACE_S)  # the last lines travel after the result
            return result
        finally:
            if not future.done():
                stop(future)
            client.unsubscribe_topic(topic)


def on_worker(command: Command, token: str, topic: str, shipment: Shipment | None = None) -> Finished:
    """The Dask task: run the command next to the worker, sending its lines in batches."""
    from dataclasses import replace

    from distributed import get_worker

    from conveyor.run.unshared import CHECKPOINT, command_in_scratch, run_in_scratch, stopped_when_released

    worker = get_worker()
    batch = _Batch(lambda lines: worker.log_event(topic, lines))
    try:  # on every cluster: Dask lets a running task go on once its client is gone (kill -9 of the runner)
        with stopped_when_released(lambda: cancel_on_worker(token)):
            if shipment is None:
                return run_here(command, batch.add, token=token, budget=worker_budget(worker))
            finished, outs = run_in_scratch(
                shipment, lambda scratch: run_here(command_in_scratch(command, shipment, scratch), batch.add,
                                                   token=token, budget=worker_budget(worker)),
                lambda line: batch.add("err", line), succeeded=lambda done: done.returncode == 0,
                stored=lambda value: batch.add(CHECKPOINT, value))
        return replace(finished, outs=outs)
    finally:
        batch.close()
        worker.log_event(topic, None)


def cancel_on_worker(token: str) -> None:
    """Kill the process group of the command running under ``token`` on this worker, if any."""
    with _RUNNING_LOCK:
        guard = _RUNNING.get(token)
    if guard is not None:
        escaped = descendants(guard.pid) if guard.poll() is None else []
        _signal_group(guard.pid, signal.SIGKILL)
        signal_all(escaped, signal.SIGKILL)


class _Batch:
    """Lines collected and sent every 0.2 s: a chatty command must not flood the scheduler."""

    def __init__(self, send: Callable[[list[tuple[str, str]]], None], every_s: float = 0.2) -> None:
        self.send = send
        self.lines: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(every_s,), name="conveyor-lines", daemon=True)
        self.thread.start()

    def add(self, stream: str, line: str) -> None:
        with self.lock:
            self.lines.append((stream, line))

    def _loop(self, every_s: float) -> None:
        while not self.stopped.wait(every_s):
            self._flush()

    def _flush(self) -> None:
        with self.lock:
            lines, self.lines = self.lines, []
        if lines:
            self.send(lines)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._flush()
