"""The Dask workers a stage runs on: why did they die, are there any left, and restarting them
after an attempt that may have left them blocked or broken.

Prefect-free and free of heavy imports: only the started profile's client is used.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from conveyor.errors import StageError
from conveyor.run.nanny_env import undo_nanny_environ
from conveyor.run.watchdog import raise_in

if TYPE_CHECKING:
    from distributed import Client

    from conveyor.run.profiles import Resources
    from conveyor.run.tree_memory import CommandOverMemory


def restart(resources: Resources, log: logging.Logger, when: str, others: list[str]) -> None:
    """Restart the workers of a cluster conveyor started, unless ``others`` (stages) use it now:
    a failed or timed-out attempt may leave them blocked (a collective waiting for a dead peer,
    a long C call) or broken (xgboost's collective after a peer died), and a retry on them
    would fail or hang the same way. A cluster given by ``address:`` is never restarted."""
    if resources.client is None or resources.external:
        return
    if others:
        log.warning("%s: the workers of profile '%s' were not restarted: %s use them",
                    when, resources.profile, ", ".join(others))
        return
    try:
        with undo_nanny_environ():  # the nannies set their variables on this process again as they respawn
            resources.client.restart(timeout=120)
        log.warning("%s: restarted the workers of profile '%s' (what the stage left there is stopped)",
                    when, resources.profile)
    except Exception as exc:  # noqa: BLE001 - the stage's own error is the one to report
        log.warning("%s: restarting the workers of profile '%s' failed: %s", when, resources.profile, exc)


def died(exc: BaseException, resources: Resources) -> str:
    """Why a stage failed when Dask gave up on a task whose workers kept dying (KilledWorker)."""
    args: tuple[Any, ...] = exc.args
    task = f" {args[0]!r}" if args else ""
    tried = f" on {args[2] + 1} workers in turn" if len(args) > 2 and isinstance(args[2], int) else ""
    what = f"Dask workers of profile '{resources.profile}' died running its task{task}{tried} (KilledWorker)"
    if resources.memory_limit is not None:
        return (f"{what}; {_budget(resources.memory_limit, 'a worker')}: raise memory_limit or make the "
                "partitions smaller")
    return f"{what}; the workers' logs say why (memory, a crash in native code)"


def over_memory(exc: CommandOverMemory, resources: Resources) -> str:
    """Why a ``cmd`` stage failed when its processes on a worker went past the worker's budget:
    in the words a task that kills its workers gets (:func:`died`)."""
    limit = resources.memory_limit or f"{exc.limit / 2**20:.0f}MiB"
    raise_it = "start the workers with a larger --memory-limit" if resources.external else "raise memory_limit"
    return (f"its command's processes on a Dask worker of profile '{resources.profile}' used "
            f"{exc.used / 2**20:.0f} MiB; {_budget(limit, 'a command', exc.fraction)}: {raise_it} "
            "or make the command use less memory")


def _budget(limit: str, who: str, fraction: float = 0.95) -> str:
    return f"each worker may use {limit} (memory_limit), and {who} past {fraction:.0%} of it is killed"


class NoWorkersLeft(Exception):
    """Raised into a stage's thread when its scheduler has had no worker for too long (no arguments)."""


class NoWorkers(StageError):
    """A stage's scheduler had no worker for the profile's ``no_workers_timeout_s``: Dask would wait forever."""

    def __init__(self, stage: str, profile: str, address: str, waited_s: float, unanswered: str = "") -> None:
        heard = f" (the scheduler did not answer: {unanswered})" if unanswered else ""
        super().__init__(stage, f"the Dask scheduler at {address} (profile '{profile}') has had no workers for "
                                f"{waited_s:g}s (no_workers_timeout_s){heard}: its workers died or were stopped; "
                                "start workers for it and run again (what succeeded is skipped)")
        self.profile, self.address, self.waited_s, self.unanswered = profile, address, waited_s, unanswered

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage, self.profile, self.address, self.waited_s, self.unanswered))


class WorkersEnded(StageError):
    """A stage's workers are gone for good: the batch system ended the jobs that ran them (``why``:
    in its words, e.g. Slurm's ``TIMEOUT (TimeLimit)``). Dask alone would wait for new ones forever."""

    def __init__(self, stage: str, profile: str, why: str) -> None:
        super().__init__(stage, f"the workers of profile '{profile}' are gone: {why}; "
                                "run again (what succeeded is skipped)")
        self.profile, self.why = profile, why

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage, self.profile, self.why))


class WorkerWatch:
    """While a stage runs on a cluster (``with WorkerWatch(...):``), fail it once the scheduler has
    had no worker for the profile's ``no_workers_timeout_s``.

    Dask keeps the tasks of a cluster with no workers waiting for one that may never come (the
    workers of an existing cluster killed, or never started), and nothing says so. A worker
    that joins in time lets the stage go on: Dask gives it the waiting tasks. At the bound,
    :class:`NoWorkersLeft` is raised into the stage's thread (a command's wait at once, a
    task's wait on Dask futures within 10 s) and leaves this block as :class:`NoWorkers`.
    On a batch system (``Resources.ended``: Slurm) there is no bound, since a job may wait in the
    queue for hours; the stage fails, as :class:`WorkersEnded`, once it says the jobs ended.
    """

    def __init__(self, stage: str, resources: Resources) -> None:
        self.stage, self.resources = stage, resources
        self.timeout_s = resources.no_workers_timeout_s if resources.client is not None else None
        self.ended = resources.ended if resources.client is not None else None
        self.poll_s = min(1.0, self.timeout_s / 5) if self.timeout_s is not None else 1.0
        self.fired = False
        self.why = ""  # the batch system's word on why the workers are gone, when it gave one
        self.unanswered = ""  # why the scheduler did not answer the last look, if it did not
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.current_thread()

    def __enter__(self) -> WorkerWatch:
        if self.timeout_s is not None or self.ended is not None:
            self._thread = threading.current_thread()
            threading.Thread(target=self._watch, name=f"conveyor-workers-{self.stage}", daemon=True).start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            self._stopped.set()
            if not self.fired:
                return
            if self._thread.ident is not None:
                raise_in(self._thread.ident, None)  # if not delivered yet: it must not land after this block
        if exc_type is not None and not issubclass(exc_type, Exception):
            return  # Ctrl-C: that is what stopped the stage
        if self.why:
            raise WorkersEnded(self.stage, self.resources.profile, self.why) from None
        address = str(getattr(self.resources.client.scheduler, "address", "?")) if self.resources.client else "?"
        raise NoWorkers(self.stage, self.resources.profile, address, float(self.timeout_s or 0),
                        self.unanswered) from None

    def _watch(self) -> None:
        """Look every ``poll_s``; fire once no worker was seen for ``timeout_s``, or once the batch
        system says that the profile's workers are gone for good (no worker seen meanwhile)."""
        seen = time.monotonic()
        while not self._stopped.wait(self.poll_s):
            if self._workers() > 0:
                seen = time.monotonic()
                continue
            self.why = self.ended() if self.ended is not None else ""
            if self.why or (self.timeout_s is not None and time.monotonic() - seen >= self.timeout_s):
                with self._lock:
                    if not self._stopped.is_set() and self._thread.ident is not None:
                        self.fired = True
                        raise_in(self._thread.ident, NoWorkersLeft)
                return

    def _workers(self) -> int:
        """How many workers the scheduler has now (0 when it does not answer within a few seconds)."""
        assert self.resources.client is not None
        n, self.unanswered = _count(self.resources.client, self.poll_s)
        return n


# the last answer of each client's scheduler, shared by the stages on it: a matrix of a hundred
# commands asks once a second, not a hundred times
_ASKED: weakref.WeakKeyDictionary[Client, tuple[float, int, str]] = weakref.WeakKeyDictionary()
_ASKED_LOCK = threading.Lock()


def _count(client: Client, fresh_s: float) -> tuple[int, str]:
    """The scheduler's workers, and why it did not answer ("" when it did); an answer younger than
    ``fresh_s`` is reused."""
    with _ASKED_LOCK:
        when, n, unanswered = _ASKED.get(client, (-fresh_s, 0, ""))  # (when, workers, why unanswered)
        if time.monotonic() - when < fresh_s:
            return n, unanswered
    try:
        n, unanswered = len(client.nthreads(callback_timeout=max(fresh_s, 5.0))), ""
    except Exception as exc:  # noqa: BLE001 - an unreachable scheduler gives no worker either
        n, unanswered = 0, str(exc) or type(exc).__name__
    with _ASKED_LOCK:
        _ASKED[client] = (time.monotonic(), n, unanswered)
    return n, unanswered
