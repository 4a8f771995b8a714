"""The callback that saves the booster every N rounds while xgboost trains (imports xgboost:
loaded only when a training saves checkpoints)."""

from __future__ import annotations

from typing import Any

import xgboost as xgb
from xgboost.callback import TrainingCallback

from conveyor.train.xgb_checkpoint import History, Rounds, save_booster


class SaveEvery(TrainingCallback):
    """After every ``rounds.every``-th round, rank 0 saves the booster and the history so far
    (:func:`conveyor.train.xgb_checkpoint.save_booster`); picklable, to run on Dask workers."""

    def __init__(self, rounds: Rounds) -> None:
        super().__init__()
        self.checkpoint, self.every, self.total = rounds.checkpoint, rounds.every, rounds.total
        self.early_stopping_rounds = rounds.early_stopping_rounds
        self.before: History = Rounds.merged({}, rounds.history)  # a copy: the rounds before this call

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        done = model.num_boosted_rounds()
        if self.checkpoint is None or done % self.every or done >= self.total or xgb.collective.get_rank() != 0:
            return False  # the last round is saved by the caller, with the booster it returns
        history = Rounds.merged(self.before, evals_log)
        probe = Rounds(self.total, self.early_stopping_rounds, self.every, None, history)
        save_booster(self.checkpoint, bytes(model.save_raw("ubj")), done, self.total, history, probe.patience_spent())
        return False
