"""The runner's side of checkpoints (:mod:`conveyor.run.checkpoints`): which folder an attempt
gets, what the log, the record and the live view say it resumes, and the time that saved."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from conveyor.run import checkpoints

if TYPE_CHECKING:
    from conveyor.plan.fingerprint import Hasher
    from conveyor.run.logs import StageLog
    from conveyor.run.record import RunRecord, StageRecord
    from conveyor.spec.project import Project


RESUMED = "resumed from"


class Notices(Protocol):
    def notice(self, stage: str, line: str) -> None: ...


def checkpoint(project: Project, stage: str, run: RunRecord, hasher: Hasher, log: StageLog,
               view: Notices, running: Collection[Path] = ()) -> checkpoints.Checkpoint:
    """The attempt's checkpoint folder, keyed by the stage's inputs as they are now; the checkpoints
    of other inputs are dropped (the log says so), and a resumed one is told everywhere. The
    project's checkpoints are then bounded (the oldest dropped), sparing this one and ``running``."""
    key = checkpoints.inputs_key(project, stage, hasher)
    found, progress, dropped = checkpoints.prepare(project.root, stage, key, run.run_id)
    for old in dropped:
        log.line("log", f"a checkpoint at {old.describe()} was saved with other inputs (params, deps, "
                 "code or command changed since): dropped, starting from scratch")
    most = checkpoints.limit()
    for gone in checkpoints.bound(project.root, most, keep={found.path, *running}):
        at = f" at {gone.progress.where()}" if gone.progress is not None else ""
        log.line("log", f"the checkpoint of stage '{gone.stage}'{at} ({gone.size / 2**20:,.1f} MiB) dropped, the "
                 f"oldest: the project's checkpoints held more than {checkpoints.ENV_MAX}={most:,} bytes")
    if progress is not None:
        line = f"resumes from {progress.describe()}"
        log.line("log", line)
        view.notice(stage, f"{stage} {line}")
        record = run.stages[stage]
        record.resumed = {"step": progress.step, "total": progress.total, "unit": progress.unit,
                          "run_id": progress.run_id}
        # the summary and `conveyor runs` show the reason: one "resumed from" (of the latest attempt)
        record.reason = record.reason.split(f"; {RESUMED}")[0] + f"; {RESUMED} {progress.describe()}"
    return found


def time_saved(record: StageRecord, seconds: float) -> None:
    """A resumed stage's record gets its wall and the time the checkpoint saved, estimated from the
    share of the work it held: this attempt did the rest in ``seconds``."""
    resumed = record.resumed
    if resumed is None or not resumed["total"] or resumed["step"] >= resumed["total"]:
        return
    resumed["wall_s"] = round(seconds, 3)
    resumed["saved_s"] = round(seconds * resumed["step"] / (resumed["total"] - resumed["step"]), 3)
