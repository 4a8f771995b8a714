"""``ctx.report(step, value)``: a stage's intermediate values, heard by a search that prunes.

A task that reports a value per step (an epoch's validation loss) lets ``conveyor search
--prune`` stop a trial that is already worse than the trials before it at that step
(Optuna's MedianPruner): :func:`report` raises :class:`TrialPruned` in the task, the stage
runner unwinds it as any failure (the trial's outs go), and the search records the trial
pruned. Outside a search that prunes, a report is heard by no one and costs a lookup.

The listener is the calling thread's (a context variable set around the trial's stage), so
a report from a task running in the trial's thread is heard; a ``cmd`` stage, a
``deterministic: true`` task (a process of its own) or work on Dask workers reports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from conveyor.errors import StageError

Listener = Callable[[int, float], bool]  # (step, value) -> whether the trial should stop now
_LISTENER: ContextVar[Listener | None] = ContextVar("conveyor_report_listener", default=None)


class TrialPruned(StageError):
    """A search stopped this trial at ``step``: its reports were worse than the trials before it."""

    def __init__(self, stage: str, step: int, value: float) -> None:
        super().__init__(stage, f"pruned at step {step} (it reported {value:.6g})")
        self.step, self.value = step, value

    def __str__(self) -> str:
        return self.reason


def report(stage: str, step: int, value: float) -> None:
    """Tell the search ``value`` at ``step``; raises :class:`TrialPruned` when it stops the trial."""
    listener = _LISTENER.get()
    if listener is not None and listener(int(step), float(value)):
        raise TrialPruned(stage, int(step), float(value))


@contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """``listener`` hears the reports made in this thread while the block runs."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
