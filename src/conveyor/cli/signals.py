"""Ctrl-C, SIGTERM and a closed terminal (SIGHUP) on the command line: which signal stopped a
command, what it stopped, and the exit (130, 143 or 129) that does not wait for a stage
abandoned in a C call. A closed terminal stops a run as Ctrl-C does (previous outs back at
once, the record ``interrupted``); what would be said to it is lost with it, never an error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console

from conveyor.errors import Interrupted
from conveyor.spec.project import Project

if TYPE_CHECKING:
    from conveyor.run.session import RunOptions

STOPPED = "clusters, workers and commands were stopped; outs of unfinished stages are unchanged"
_SIGNAL: list[str] = []  # the signal that stopped this command, once one has
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_TERMINAL: list[int] = []  # the device of the terminal this command was started on, if any


def install() -> None:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`: clusters are cleaned up on `kill`
    and when the terminal closes as on Ctrl-C."""
    for signum in STOPPING:
        signal.signal(signum, _interrupt)
    for fd in (2, 1, 0):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                _TERMINAL[:] = [os.fstat(fd).st_rdev]
                break


def received() -> bool:
    """Whether SIGINT, SIGTERM or SIGHUP reached this command."""
    return bool(_SIGNAL)


def exit_code(name: str) -> int:
    """128 + the signal's number, as a shell reports a command it stopped: 130, 143, 129."""
    return 128 + int(getattr(signal.Signals, name, signal.SIGINT))


def say(err: Console, what: object) -> None:
    """Print to a terminal that may have closed (SIGHUP): then there is no one to tell."""
    with contextlib.suppress(OSError):
        if isinstance(what, str):
            err.print(what, highlight=False, soft_wrap=True)
        else:
            err.print(what, crop=False)  # the summary's paths and commands stay whole (its lines do not wrap)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _SIGNAL[:] = [signal.Signals(signum).name]
    if signum == signal.SIGHUP:
        _silence_terminal()
    raise Interrupted(_SIGNAL[0])


def _silence_terminal() -> None:
    """The terminal hung up: every descriptor of it (the live view holds a copy of its own) now
    points at /dev/null, so that what would be printed is dropped instead of failing with EIO
    in whatever writes it (the live view, a summary, a library's last log line)."""
    if not _TERMINAL:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        try:
            fds = [int(name) for name in os.listdir("/proc/self/fd")]
        except OSError:  # no /proc: the standard three
            fds = [0, 1, 2]
        for fd in fds:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if fd != null and stat.S_ISCHR(st.st_mode) and st.st_rdev == _TERMINAL[0]:
                    os.dup2(null, fd)
    finally:
        os.close(null)


def stopped(err: Console, what: str = STOPPED) -> NoReturn:
    """Say what Ctrl-C or SIGTERM stopped; exit 130 or 143 without waiting for threads: a stage
    blocked in a C call was abandoned (its outs put back) and must not hold the process, and
    servers and clusters have already stopped."""
    for signum in STOPPING:  # a second Ctrl-C must not cut this short
        signal.signal(signum, signal.SIG_IGN)
    name = _SIGNAL[0] if _SIGNAL else "SIGINT"
    say(err, f"interrupted ({name}): {what}")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # the terminal closed
            stream.flush()
    os._exit(exit_code(name))


def interrupted_run(out: Console, err: Console, project: Project, run_id: str, exc: KeyboardInterrupt,
                    options: RunOptions | None = None) -> NoReturn:
    """Ctrl-C, SIGTERM or SIGHUP during a run, once everything it started has stopped: what the run
    did (its summary, on ``out`` as a finished run's) and what was stopped (one line on ``err``), and
    how to finish it (``options``: the run's); then exit 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP)."""
    from conveyor.cli.view import resume_interrupted, summary
    from conveyor.run.record import close_before_flow, record_path

    if isinstance(exc, Interrupted):
        _SIGNAL[:] = [exc.signal_name]
    path = record_path(project.root, run_id)
    record = close_before_flow(project, run_id, interrupted=True)  # if stopped while its server started
    if record is None:  # interrupted before the run wrote its record: it had decided nothing
        stopped(err, "before any stage started: nothing changed")
    say(out, summary(record, project, resume_interrupted(project, record, options)))
    names = record.interrupted
    what = f"stopped {', '.join(names)} (previous outs kept)" if names else "no stage was running"
    stopped(err, f"{what}; clusters, workers and commands were stopped; record: {project.rel(path)}")
