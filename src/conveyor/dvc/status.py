"""What is stale and why, for ``conveyor status`` and ``run --dry-run``: a question, which never
waits, refuses or writes.

It is asked of the project's record as a run would ask it, under DVC's repository lock, when
that lock can be had. While a run (or ``dvc repro``) holds it, or where no one can take it (a
read-only checkout: DVC cannot create ``.dvc/tmp/lock``), the record is read as it stands: the
answer is the state before the run, each of its stages as recorded so far. The outs of a stage
running now are in the outs journal, not missing, so they are not called missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from conveyor.dvc.record import DvcRecord, open_record
from conveyor.errors import RunLockedError, UnwritableError
from conveyor.plan.fingerprint import Record, param_changes, plan
from conveyor.run.journal import Journal
from conveyor.spec.overrides import Override, reads
from conveyor.spec.project import Project


def stale(project: Project, selected: set[str], *, force: bool = False,
          changes: Sequence[Override] = (), allow_missing: bool = False) -> dict[str, list[str]]:
    """Why each selected stage would run; up-to-date stages map to ``[]``.

    ``changes``: ``-S`` values not written (``run --dry-run -S``); ``project`` was read with
    them, and the stages that read them are due as they would be once the file holds them.
    ``allow_missing``: as ``run --allow-missing`` decides (missing data alone is no change).
    """
    record: Record = open_record(project, question=True, allow_missing=allow_missing)
    with ExitStack() as held:
        try:
            held.enter_context(record.session())
        except (RunLockedError, UnwritableError):  # a run holds DVC's lock, or the checkout is read-only
            record = held.enter_context(DvcRecord(project, question=True, allow_missing=allow_missing).unlocked())
        reasons = plan(project, selected, _Overridden(record, project, changes) if changes else record, force=force)
    return _without_running_outs(reasons, Journal(project.root).running())


class _Overridden:
    """A record's answers as they would be with the ``-S`` values in the params file (DVC reads
    params from the file, which a dry run leaves alone); only :meth:`reasons` is asked of it."""

    def __init__(self, inner: Record, project: Project, changes: Sequence[Override]) -> None:
        self.inner, self.project, self.changes = inner, project, changes

    def reasons(self, stage: str) -> list[str]:
        found = self.inner.reasons(stage)
        mine = [r for c in self.changes if reads(self.project, stage, c) for r in param_changes(
            {c.key: c.old}, {c.key: c.new})]
        return found + [r for r in mine if r not in found and found != ["never run"]]

    def session(self) -> AbstractContextManager[Any]:
        return self.inner.session()

    def reload(self) -> None:
        self.inner.reload()

    def prepare(self, stage: str) -> None:
        raise NotImplementedError("a question runs nothing")

    def restore(self, stage: str) -> bool:
        raise NotImplementedError("a question runs nothing")

    def save(self, stage: str) -> list[str]:
        raise NotImplementedError("a question runs nothing")


def _without_running_outs(reasons: dict[str, list[str]], running: dict[str, list[str]]) -> dict[str, list[str]]:
    """``reasons`` less "out missing" for the outs a running stage moved into the journal."""
    moved = {stage: {f"out missing: {path}" for path in outs} for stage, outs in running.items()}
    return {stage: [r for r in why if r not in moved.get(stage, set())] for stage, why in reasons.items()}
