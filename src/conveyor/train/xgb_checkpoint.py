"""Boosting that a stopped run resumes: the booster every N rounds, saved atomically.

xgboost continued from a saved booster (``xgb_model=``) gives the very bytes of an
uninterrupted run where nothing is drawn at random: then training is one call, and a callback
(:mod:`conveyor.train.xgb_saver`, rank 0 on Dask) saves every N rounds; a resumed run is one
call continued from the latest save. With ``subsample``, ``colsample_*`` or dart it draws anew
from its seed at each continuation (measured, xgboost 3.2 hist on CPU: the trees differ from
the first continued round), so every run, stopped or not, trains the same segments of N
rounds, each continued from the previous one's saved bytes: a resumed run makes exactly the
calls an uninterrupted one makes after that point. Both ways give a byte-identical booster;
segments cost a prediction of every tree so far at each continuation.

On disk, in the stage's checkpoint folder: ``xgboost-000300.ubj`` (the booster after 300
rounds, written through a temporary file, fsync and rename), then ``progress.json`` naming it
with the evaluation history (:meth:`conveyor.run.checkpoints.Checkpoint.mark`, atomic too).
Only what ``progress.json`` names is resumed, so a kill anywhere in a save leaves the previous
checkpoint whole; files of saves it does not name are removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.run import checkpoints

if TYPE_CHECKING:
    import xgboost as xgb

History = dict[str, dict[str, list[float]]]
# one segment: continue ``model`` (None: start) for ``n`` rounds with ``callbacks``; the booster and
# that segment's evaluation history
Segment = Callable[["xgb.Booster | None", int, list[Any]], tuple["xgb.Booster", Any]]
UNIT = "round"


@dataclass
class Rounds:
    """The rounds of one training: how many, saved every ``every`` where (if anywhere), in one call or segments."""

    total: int
    early_stopping_rounds: int | None
    every: int
    checkpoint: checkpoints.Checkpoint | None
    history: History = field(default_factory=dict)
    saved: bytes | None = None  # the booster after the latest segment
    stopped: bool = False  # early stopping ended it
    draws: bool = False  # the params draw at random: segments of ``every`` rounds

    @classmethod
    def open(cls, total: int, early_stopping_rounds: int | None, every: int, folder: Path | None,
             params: Mapping[str, Any]) -> Rounds:
        """``folder`` None: the stage's checkpoint folder (none outside a run); what it holds is resumed."""
        found = checkpoints.current()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            found = checkpoints.Checkpoint(folder, found.run_id if found is not None else "")
        rounds = cls(total, early_stopping_rounds, every, found if every > 0 else None,
                     draws=draws_at_random(params))
        rounds._resume()
        return rounds

    def run(self, segment: Segment) -> xgb.Booster:
        """Train the rounds not done yet, the booster saved every ``every`` rounds; the final booster.

        Params that draw at random go in segments of ``every`` rounds, each continued from the
        saved bytes; others in one call that a callback saves from (continuing from the bytes
        costs a prediction of every tree so far on the training rows: quadratic in segments).
        """
        import xgboost as xgb

        done = self._done()
        while done < self.total and not self.stopped:
            n = min(self.every, self.total - done) if self.every > 0 and self.draws else self.total - done
            model = _load(self.saved) if self.saved is not None else None
            booster, history = segment(model, n, self._callbacks() + self._saver())
            self.history = self.merged(self.history, history)
            self.stopped = booster.num_boosted_rounds() < done + n or self.patience_spent()
            self.saved = bytes(booster.save_raw("ubj"))
            done = booster.num_boosted_rounds()
            if self.checkpoint is not None:
                save_booster(self.checkpoint, self.saved, done, self.total, self.history, self.stopped)
        return _load(self.saved) if self.saved is not None else xgb.Booster()

    def _saver(self) -> list[Any]:
        """The callback that saves within a call (none where segments are as long as ``every``)."""
        if self.checkpoint is None or self.draws:
            return []
        from conveyor.train.xgb_saver import SaveEvery

        return [SaveEvery(self)]

    def _done(self) -> int:
        return _load(self.saved).num_boosted_rounds() if self.saved is not None else 0

    def _callbacks(self) -> list[Any]:
        """Early stopping that remembers the rounds before this segment: their scores replayed."""
        if not self.early_stopping_rounds:
            return []
        from xgboost.callback import EarlyStopping

        stopping = EarlyStopping(rounds=self.early_stopping_rounds)
        if self.history:
            name = list(self.history)[-1]
            metric = list(self.history[name])[-1]
            for epoch, score in enumerate(self.history[name][metric]):
                stopping.after_iteration(_NoModel(), epoch, {name: {metric: [score]}})
        return [stopping]

    def patience_spent(self) -> bool:
        """Early stopping ended it on a segment's last round (xgboost returns as if it had not)."""
        stopping = self._callbacks()
        return bool(stopping) and stopping[0].current_rounds >= stopping[0].rounds

    @staticmethod
    def merged(before: History, more: Any) -> History:
        """The evaluation history ``before``, then ``more`` (a call's own, from its first round)."""
        merged = {name: {metric: list(scores) for metric, scores in metrics.items()}
                  for name, metrics in before.items()}
        for name, metrics in more.items():
            for metric, scores in metrics.items():
                merged.setdefault(name, {}).setdefault(metric, []).extend(float(s) for s in scores)
        return merged

    def _resume(self) -> None:
        """Take up the latest complete save, if there is one (of this same training)."""
        if self.checkpoint is None:
            return
        progress = self.checkpoint.progress()
        model = progress.state.get("model") if progress is not None and progress.unit == UNIT else None
        if progress is None or not isinstance(model, str) or progress.total != self.total:
            _remove_others(self.checkpoint.path, keep=None)
            return
        self.saved = (self.checkpoint.path / model).read_bytes()
        self.history = progress.state.get("history") or {}
        self.stopped = bool(progress.state.get("stopped"))
        _remove_others(self.checkpoint.path, keep=model)


def save_booster(checkpoint: checkpoints.Checkpoint, raw: bytes, done: int, total: int, history: History,
                 stopped: bool) -> None:
    """The booster after ``done`` rounds, then the progress naming it, then older saves go."""
    name = f"xgboost-{done:06d}.ubj"
    checkpoints.write_atomically(checkpoint.path / name, raw)
    checkpoint.mark(done, total, UNIT, state={"model": name, "history": history, "stopped": stopped})
    _remove_others(checkpoint.path, keep=name)


def draws_at_random(params: Mapping[str, Any]) -> bool:
    """Whether xgboost draws at random with ``params`` (row or column sampling, dart's dropouts, a
    random feature selector): then a continuation from saved bytes draws anew from the seed."""
    sampled = any(float(value) < 1 for key, value in params.items()
                  if key in ("subsample", "colsample_bytree", "colsample_bylevel", "colsample_bynode"))
    return sampled or params.get("booster") == "dart" or params.get("feature_selector") in ("random", "shuffle")


class _NoModel:
    """What early stopping's replayed rounds mark their best on: nothing (the booster has it)."""

    def set_attr(self, **_: Any) -> None:
        return None


def _load(raw: bytes) -> xgb.Booster:
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(bytearray(raw))
    return booster


def _remove_others(folder: Path, keep: str | None) -> None:
    """Booster files (and temporaries of killed saves) other than ``keep``."""
    for path in folder.glob("*xgboost-*.ubj*"):
        if path.name != keep:
            path.unlink(missing_ok=True)
