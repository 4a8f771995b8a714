"""A torch training's state in the stage's checkpoint folder: saved every N steps, resumed by the next run.

What a training needs to go on exactly where it stopped is the training's business (the model's
and optimiser's ``state_dict``, ``torch.get_rng_state()``, the epoch, early stopping's best so
far): the task gathers it in one mapping, and this module keeps the latest one whole::

    saver = TorchCheckpoint.of(ctx.checkpoint_dir, total=params.max_epochs, unit="epoch", every=10)
    if (found := saver.latest()) is not None:
        epoch, state = found
        model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    ...
    saver.maybe_save(epoch, lambda: {"model": model.state_dict(), ...})

A save is ``torch-000060.pt`` written through a temporary file, fsync and a rename, then
``progress.json`` naming it (:meth:`conveyor.run.checkpoints.Checkpoint.mark`), then older saves
go: a kill anywhere leaves the one before whole. States are read with ``weights_only=True``:
tensors, numbers, strings and containers of them.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.run import checkpoints


@dataclass(frozen=True)
class TorchCheckpoint:
    """Where (None: nowhere) and how often a training saves its state; ``total`` steps in all."""

    checkpoint: checkpoints.Checkpoint | None
    total: int
    unit: str = "epoch"
    every: int = 1

    @classmethod
    def of(cls, folder: Path | None, *, total: int, unit: str = "epoch", every: int = 1) -> TorchCheckpoint:
        """``folder``: ``ctx.checkpoint_dir`` (None outside a run, or to save nothing)."""
        found = checkpoints.current()
        if folder is None or every <= 0:
            return cls(None, total, unit, every)
        return cls(checkpoints.Checkpoint(folder, found.run_id if found is not None else ""), total, unit, every)

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The step and state of the latest complete save of this training; None: start from scratch."""
        import torch

        progress = self.checkpoint.progress() if self.checkpoint is not None else None
        name = progress.state.get("file") if progress is not None else None
        if progress is None or self.checkpoint is None or not isinstance(name, str) \
                or (progress.unit, progress.total) != (self.unit, self.total):
            return None
        state: dict[str, Any] = torch.load(self.checkpoint.path / name, weights_only=True, map_location="cpu")
        return progress.step, state

    def maybe_save(self, step: int, state: Callable[[], Mapping[str, Any]]) -> bool:
        """Save ``state()`` after ``step`` when it is a multiple of ``every`` (and not the last step:
        the stage's outs hold that); whether it saved."""
        if self.checkpoint is None or step % self.every or step >= self.total:
            return False
        self.save(step, state())
        return True

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """``state`` after ``step``, atomically; then the saves before it go."""
        import torch

        if self.checkpoint is None:
            return
        buffer = io.BytesIO()
        torch.save(dict(state), buffer)
        name = f"torch-{step:06d}.pt"
        checkpoints.write_atomically(self.checkpoint.path / name, buffer.getvalue())
        self.checkpoint.mark(step, self.total, self.unit, state={"file": name})
        for older in self.checkpoint.path.glob("*torch-*.pt*"):
            if older.name != name:
                older.unlink(missing_ok=True)
