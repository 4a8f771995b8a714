"""The reference MLP's fit resumes from its checkpoint (:mod:`conveyor.train.torch_checkpoint`) to the
very weights of a fit never stopped: Adam's moments, the RNG of the batch order and early stopping's
best so far all come back. A stop is a ``KeyboardInterrupt`` from the progress bar at an epoch, as
Ctrl-C lands in a task; a save killed half-way is a torn temporary file and a state file that
progress.json does not name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import StageProgress
from conveyor.train.seed import deterministic_torch
from conveyor.train.torch_checkpoint import TorchCheckpoint
from tasks import mlp, models

PARAMS = mlp.MlpParams(hidden=[16, 8], learning_rate=0.003, weight_decay=0.0001, batch_size=32, max_epochs=40,
                       patience=10)  # early-stopped at epoch 27, its best at 17


class StopAt(StageProgress):
    """A progress bar that stops the fit once ``epoch`` epochs are done."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.stop_at = epoch

    def advance(self, amount: float = 1.0) -> None:
        super().advance(amount)
        if self.completed >= self.stop_at:
            raise KeyboardInterrupt


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(600, 10, generator=generator)
    return x, ((x[:, 0] + x[:, 1] * x[:, 2] + 0.5 * torch.randn(600, generator=generator)) > 0).float()


def fit(folder: Path | None, progress: StageProgress) -> mlp.FitResult:
    saver = TorchCheckpoint.of(folder, total=PARAMS.max_epochs, unit="epoch", every=5)
    with deterministic_torch(7):
        model = models.build_mlp([10, *PARAMS.hidden, 1])
        return mlp.fit(model, data(0), data(1), PARAMS, progress, saver)


def assert_same_fit(one: mlp.FitResult, other: mlp.FitResult) -> None:
    assert (one.epochs, one.best_epoch, one.best_valid_loss) == (other.epochs, other.best_epoch, other.best_valid_loss)
    assert one.state.keys() == other.state.keys()
    assert all(torch.equal(one.state[k], other.state[k]) for k in one.state)


@pytest.mark.parametrize("torn", [False, True], ids=["stopped", "stopped-mid-save"])
def test_a_stopped_fit_resumes_to_the_weights_of_one_never_stopped(tmp_path: Path, torn: bool) -> None:
    whole = fit(None, StageProgress())
    assert 17 < whole.epochs <= PARAMS.max_epochs  # the stop below lands before the end
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path, StopAt(17))
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 15
    if torn:  # the save of epoch 20, killed before it named its file
        (tmp_path / ".torch-000020.pt.999999.tmp").write_bytes(b"torn")
        (tmp_path / "torch-000020.pt").write_bytes(b"torn")
    progress = StageProgress()
    resumed = fit(tmp_path, progress)
    assert_same_fit(resumed, whole)
    assert progress.completed == whole.epochs  # the bar counts the resumed epochs as done


def test_a_fit_with_nothing_saved_or_another_training_saved_starts_from_scratch(tmp_path: Path) -> None:
    TorchCheckpoint.of(tmp_path, total=99, unit="epoch").save(5, {"model": {}})  # another training's
    assert TorchCheckpoint.of(tmp_path, total=PARAMS.max_epochs, unit="epoch").latest() is None
    assert_same_fit(fit(tmp_path, StageProgress()), fit(None, StageProgress()))
