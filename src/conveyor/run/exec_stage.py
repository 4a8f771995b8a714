"""``conveyor exec STAGE``: exactly one stage, now, in this process (what ``dvc repro`` calls).

The stage runner (:mod:`conveyor.run.stage`) does the work, as in a run; what is particular
here: the run lock (beside a ``conveyor run``, two processes would write one out), recovery of
a killed run's outs first, the record (DVC's own under ``dvc repro``), and a command's lines
echoed to the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

from conveyor.errors import UNWRITABLE, ConveyorError, StageError
from conveyor.run.context import StageProgress
from conveyor.run.failures import short_error
from conveyor.run.logs import log_path
from conveyor.run.profiles import Profiles
from conveyor.run.record import RunRecord, StageRecord, new_run_id
from conveyor.run.stage import StageRunner
from conveyor.spec.project import Project
from conveyor.workspace import run_lock


class _QuietEvents:
    """Events of a single ``conveyor exec``: one log line each."""

    def started(self, stage: str, profile: str, progress: StageProgress) -> None:
        logging.getLogger("conveyor").info("%s: running on %s", stage, profile)

    def retrying(self, stage: str, attempt: int, error: str) -> None:
        logging.getLogger("conveyor").warning("%s: attempt %d failed: %s", stage, attempt, error)

    def warning(self, stage: str, line: str) -> None:
        logging.getLogger("conveyor").warning("%s", line)

    def notice(self, stage: str, line: str) -> None:
        logging.getLogger("conveyor").info("%s", line)


def _echo(stream: str, line: str) -> None:
    print(line, file=sys.stdout if stream == "out" else sys.stderr, flush=True)


def run_one(project: Project, stage: str) -> None:
    """Run exactly one stage now, in this process, with its profile (``conveyor exec``).

    Always runs. Under DVC (the spec dvc.yaml is compiled from) DVC decided it is due and
    records it itself; for a dvc.yaml run as it is, DVC's record is updated as `conveyor run`
    updates it; for any other spec conveyor's own record is. A command's
    output goes to the terminal as well as to the stage's log; one line on stderr then says how
    the stage ended and where its log is (``dvc repro`` shows nothing else of it).
    """
    from conveyor.run.session import recover_killed

    with run_lock(project.root):  # beside a `conveyor run` (or another exec), two processes would write one out
        recover_killed(project, logging.getLogger("conveyor").warning, settle=False)  # exec writes no run record
        _run_one(project, stage)


def _run_one(project: Project, stage: str) -> None:
    from conveyor.dvc.compile import compiled_from
    from conveyor.dvc.record import open_record

    run = RunRecord(run_id=new_run_id(), pipeline=project.pipeline.pipeline,
                    stages={stage: StageRecord(reason="forced")})
    record = None if compiled_from(project) else open_record(project)
    with record.session() if record is not None else nullcontext(), \
            Profiles(project.pipeline.profiles) as profiles:
        for warning in profiles.check({project.pipeline.stages[stage].on}):
            logging.getLogger("conveyor").warning("WARNING %s", warning)
        runner = StageRunner(project, profiles, True, run, _QuietEvents(), record, echo=_echo)
        runner.on_abandon = _exit_abandoned(runner)
        started = time.monotonic()
        try:
            runner(stage)
        except Exception as exc:  # one line, as `conveyor run`'s summary says it, never a traceback
            if _said_already(exc):
                raise
            why = _first_line(exc.reason) if isinstance(exc, StageError) else short_error(exc)
            raise StageError(stage, f"{why} (after {time.monotonic() - started:.1f}s); "
                                    f"its log: {_log(project, run, stage)}") from exc
        print(f"{stage}: succeeded in {time.monotonic() - started:.1f}s on {run.stages[stage].where}; "
              f"its log: {_log(project, run, stage)}", file=sys.stderr, flush=True)


def _said_already(exc: Exception) -> bool:
    """conveyor's own errors other than the stage's (a profile, the cache, a read-only disk): the
    command line prints them as they are, with their exit code."""
    unwritable = isinstance(exc, OSError) and exc.errno in UNWRITABLE
    return unwritable or (isinstance(exc, ConveyorError) and not isinstance(exc, StageError))


def _first_line(reason: str) -> str:
    """A stage error's first line, without what introduces the lines under it (a command's last
    lines of stderr: exec has shown them on the terminal already)."""
    first = reason.splitlines()[0] if reason else reason
    if first.endswith(":") and "; " in first:
        return first.rpartition("; ")[0]
    return first


def _log(project: Project, run: RunRecord, stage: str) -> str:
    return project.rel(log_path(project.root, run.run_id, stage))


def _exit_abandoned(runner: StageRunner) -> Callable[[str], None]:
    """``conveyor exec`` runs its stage in the main thread: when that stage is abandoned at its
    timeout (its previous outs already put back), the process ends with its error, exit 1."""

    def give_up(stage: str) -> None:
        print(str(runner.abandoned(stage)), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    return give_up
