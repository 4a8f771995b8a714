"""What is stale and why, for ``conveyor status`` and ``run --dry-run``: a question, which never
waits, refuses or writes.

It is asked of the project's record as a run would ask it, under DVC's repository lock, when
that lock can be had. While a run (or ``dvc repro``) holds it, or where no one can take it (a
read-only checkout: DVC cannot create ``.dvc/tmp/lock``), the record is read as it stands: the
answer is the state before the run, each of its stages as recorded so far. The outs of a stage
running now are in the outs journal, not missing, so they are not called missing.
"""

from __future__ import annotations

from contextlib import ExitStack

from conveyor.dvc.record import DvcRecord, open_record
from conveyor.errors import RunLockedError, UnwritableError
from conveyor.plan.fingerprint import Record, plan
from conveyor.run.journal import Journal
from conveyor.spec.project import Project


def stale(project: Project, selected: set[str], *, force: bool = False) -> dict[str, list[str]]:
    """Why each selected stage would run; up-to-date stages map to ``[]``."""
    record: Record = open_record(project)
    with ExitStack() as held:
        try:
            held.enter_context(record.session())
        except (RunLockedError, UnwritableError):  # a run holds DVC's lock, or the checkout is read-only
            record = held.enter_context(DvcRecord(project).unlocked())
        reasons = plan(project, selected, record, force=force)
    return _without_running_outs(reasons, Journal(project.root).running())


def _without_running_outs(reasons: dict[str, list[str]], running: dict[str, list[str]]) -> dict[str, list[str]]:
    """``reasons`` less "out missing" for the outs a running stage moved into the journal."""
    moved = {stage: {f"out missing: {path}" for path in outs} for stage, outs in running.items()}
    return {stage: [r for r in why if r not in moved.get(stage, set())] for stage, why in reasons.items()}
