"""Ctrl-C and SIGTERM on the command line: which signal stopped a command, what it stopped,
and the exit (130 or 143) that does not wait for a stage abandoned in a C call.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import NoReturn

from rich.console import Console

from conveyor.errors import Interrupted
from conveyor.spec.project import Project

STOPPED = "clusters, workers and commands were stopped; outs of unfinished stages are unchanged"
_SIGNAL: list[str] = []  # the signal that stopped this command, once one has


def install() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted`: clusters are cleaned up on `kill` as on Ctrl-C."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def received() -> bool:
    """Whether SIGINT or SIGTERM reached this command."""
    return bool(_SIGNAL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _SIGNAL[:] = [signal.Signals(signum).name]
    raise Interrupted(_SIGNAL[0])


def stopped(err: Console, what: str = STOPPED) -> NoReturn:
    """Say what Ctrl-C or SIGTERM stopped; exit 130 or 143 without waiting for threads: a stage
    blocked in a C call was abandoned (its outs put back) and must not hold the process, and
    servers and clusters have already stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name = _SIGNAL[0] if _SIGNAL else "SIGINT"
    err.print(f"interrupted ({name}): {what}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(143 if name == "SIGTERM" else 130)


def interrupted_run(err: Console, project: Project, run_id: str, exc: KeyboardInterrupt) -> NoReturn:
    """Ctrl-C or SIGTERM during a run, once everything it started has stopped: what the run did
    and what was stopped, then exit 130 (SIGINT) or 143 (SIGTERM)."""
    from conveyor.cli.view import summary
    from conveyor.run.record import close_before_flow, record_path

    if isinstance(exc, Interrupted):
        _SIGNAL[:] = [exc.signal_name]
    path = record_path(project.root, run_id)
    record = close_before_flow(project, run_id, interrupted=True)  # if stopped while its server started
    if record is None:  # interrupted before the run wrote its record: it had decided nothing
        stopped(err, "before any stage started: nothing changed")
    err.print(summary(record, project, f"conveyor run{project.spec_option}"))
    names = record.interrupted
    what = f"stopped {', '.join(names)} (previous outs kept)" if names else "no stage was running"
    stopped(err, f"{what}; clusters, workers and commands were stopped; record: {project.rel(path)}")
