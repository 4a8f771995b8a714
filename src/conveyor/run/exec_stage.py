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
from collections.abc import Callable
from contextlib import nullcontext

from conveyor.run.context import StageProgress
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


def _echo(stream: str, line: str) -> None:
    print(line, file=sys.stdout if stream == "out" else sys.stderr, flush=True)


def run_one(project: Project, stage: str) -> None:
    """Run exactly one stage now, in this process, with its profile (``conveyor exec``).

    Always runs. Under DVC (the spec dvc.yaml is compiled from) DVC decided it is due and
    records it itself; for a dvc.yaml run as it is, DVC's record is updated as `conveyor run`
    updates it; for any other spec conveyor's own record is. A command's
    output goes to the terminal as well as to the stage's log.
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
        runner(stage)


def _exit_abandoned(runner: StageRunner) -> Callable[[str], None]:
    """``conveyor exec`` runs its stage in the main thread: when that stage is abandoned at its
    timeout (its previous outs already put back), the process ends with its error, exit 1."""

    def give_up(stage: str) -> None:
        print(str(runner.abandoned(stage)), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    return give_up
