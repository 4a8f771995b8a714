"""``timeout_s`` for a task stage: raised into the task's thread, and abandoned when it cannot be.

A task runs in the runner's process, where it shares the run's Dask client, executor and
logs. Python delivers an exception to a thread at that thread's next bytecode: a Python loop
stops at once, a wait on Dask futures within seconds (distributed waits in 10-s steps). A
call that never returns to Python (one long C call) cannot be stopped inside the process:
:data:`GRACE_S` after the timeout the stage is abandoned. Its previous outs go back at once,
the stage fails, the exception stays pending in its thread (so nothing it does when the call
returns is recorded), and the thread ends with the process: the command line exits without
waiting for it (:func:`stuck`). Work that must be killed at its timeout belongs in a ``cmd``
stage, whose whole process group is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from conveyor.errors import StageError

GRACE_S = 12.0  # after the timeout, for the exception to land (a Dask wait takes up to 10 s)

_STUCK: set[threading.Thread] = set()  # threads of abandoned stages (timed out or interrupted)
_STUCK_LOCK = threading.Lock()
_EXIT_HOOKED = threading.Event()  # set once the exit hook for stuck threads is registered


class TaskTimedOut(Exception):
    """Raised into a task's thread when its ``timeout_s`` has passed (by type: it has no arguments)."""


class TaskTimeout(StageError, TimeoutError):
    """A task ran past its stage's ``timeout_s`` (``abandoned``: and never returned to Python)."""

    def __init__(self, stage: str, timeout_s: float, abandoned: bool = False) -> None:
        reason = f"timed out after {timeout_s:g}s (timeout_s)"
        if abandoned:
            reason += (f"; still blocked {GRACE_S:g}s later in a call Python cannot interrupt (C code): abandoned, "
                       "its previous outs put back; run such work as a cmd stage, where the timeout kills it")
        super().__init__(stage, reason)
        self.timeout_s, self.abandoned = timeout_s, abandoned

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage, self.timeout_s, self.abandoned))


def raise_in(ident: int, exc_type: type[BaseException] | None) -> bool:
    """Raise ``exc_type`` in the thread ``ident`` at its next bytecode (None: cancel a pending one)."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    return bool(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc) == 1)


def abandoned(thread: threading.Thread) -> None:
    """``thread`` belongs to a stage that was given up on: the process must not wait for it."""
    with _STUCK_LOCK:
        _STUCK.add(thread)
        first = not _EXIT_HOOKED.is_set()
        _EXIT_HOOKED.set()
    if first:  # run first at interpreter exit (they run last-registered first), before threads are joined
        with contextlib.suppress(RuntimeError):  # the interpreter is already exiting
            threading._register_atexit(_exit_past_stuck)  # type: ignore[attr-defined]


def _exit_past_stuck() -> None:
    """The interpreter's exit, when a stage's thread is still blocked: it would join that thread
    (the pool's threads and every non-daemon thread are joined) for as long as the C call lasts.
    A process conveyor does not end itself (a deployment's flow run, in the process Prefect's
    runner or worker starts) would hold its slot, its GPU and its memory all that time.

    So the rest of the exit runs here: the other exit hooks of threads (Prefect drains its log
    and event workers there; the thread pools' join is left out) and the atexit handlers, then
    the process ends without joining threads: with 1 after an unhandled exception, else 0, as
    Prefect's engine exits once the flow run's final state is recorded (the code a
    ``sys.exit(n)`` asked for is not known here; the command line ends itself before this).
    """
    if not stuck():
        return
    from concurrent.futures import thread as pool_threads

    skip = (_exit_past_stuck, pool_threads._python_exit)
    for call in reversed(list(threading._threading_atexits)):  # type: ignore[attr-defined]
        if getattr(call, "func", call) not in skip:
            call()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    unhandled = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    os._exit(1 if unhandled is not None else 0)


def stuck() -> list[threading.Thread]:
    """The threads of abandoned stages still alive (a process exiting must not join them)."""
    with _STUCK_LOCK:
        _STUCK.difference_update([t for t in _STUCK if not t.is_alive()])
        return list(_STUCK)


class Watchdog:
    """Bounds the task call it wraps (``with Watchdog(...):``) to ``timeout_s`` seconds.

    At the timeout, :class:`TaskTimedOut` is raised into the calling thread; if the body is
    still running :data:`GRACE_S` later, ``on_stuck`` is called (from the watchdog's thread).
    Leaving the body disarms both. A body that returns (or swallows the exception) after the
    timeout fired still timed out: :class:`TaskTimedOut` is raised as it leaves.
    """

    def __init__(self, timeout_s: float, on_stuck: Callable[[], None], grace_s: float = GRACE_S) -> None:
        self.timeout_s, self.grace_s, self.on_stuck = timeout_s, grace_s, on_stuck
        self.fired = False
        self._armed = False
        self._lock = threading.Lock()
        self._thread = threading.current_thread()
        self._timers: list[threading.Timer] = []

    def __enter__(self) -> Watchdog:
        self._thread = threading.current_thread()
        self._armed = True
        for delay, action in ((self.timeout_s, self._time_out), (self.timeout_s + self.grace_s, self._give_up)):
            timer = threading.Timer(delay, action)
            timer.daemon = True
            timer.name = f"conveyor-timeout-{self._thread.name}"
            timer.start()
            self._timers.append(timer)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            self._armed = False
            for timer in self._timers:
                timer.cancel()
            if not self.fired or exc_type is not None:
                return
            if self._thread.ident is not None:
                raise_in(self._thread.ident, None)  # not delivered yet: raise it here instead
        raise TaskTimedOut()

    def _time_out(self) -> None:
        with self._lock:
            if self._armed and self._thread.ident is not None:
                self.fired = True
                raise_in(self._thread.ident, TaskTimedOut)

    def _give_up(self) -> None:
        with self._lock:
            if not self._armed:
                return
            self._armed = False  # the exception stays pending: the task records nothing when it returns
        abandoned(self._thread)
        self.on_stuck()
