"""The MLP: its params, and how it trains (in this process; :mod:`tasks.mlp_ddp` for DDP).

Adam on mini-batches, early-stopped on the valid loss, best weights kept. Seeded, with
deterministic kernels: a rerun on the same data gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from conveyor import StageProgress
    from conveyor.train.torch_checkpoint import TorchCheckpoint
    from tasks.models import Split


@dataclass(frozen=True)
class MlpParams:
    """The ``train.mlp`` params.

    ``batch_size`` is the global batch: under DDP each of N ranks takes ``batch_size // N``
    rows per step. The last two only matter under DDP: ``collective_timeout_s`` bounds the
    rendezvous and every collective, ``fail_on_rank`` makes that rank raise at its first
    step (fault injection, for tests of the failure path).
    """

    hidden: list[int]
    learning_rate: float
    weight_decay: float
    batch_size: int
    max_epochs: int
    patience: int
    collective_timeout_s: float = 300.0
    fail_on_rank: int | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> MlpParams:
        fail_on_rank = params.get("fail_on_rank")
        return cls(
            hidden=[int(n) for n in params["hidden"]],
            learning_rate=float(params["learning_rate"]),
            weight_decay=float(params.get("weight_decay", 0.0)),
            batch_size=int(params["batch_size"]),
            max_epochs=int(params["max_epochs"]),
            patience=int(params["patience"]),
            collective_timeout_s=float(params.get("collective_timeout_s", 300.0)),
            fail_on_rank=None if fail_on_rank is None else int(fail_on_rank),
        )


@dataclass
class FitResult:
    """What an MLP fit reports: best weights, and the losses to judge it by."""

    state: dict[str, torch.Tensor]
    best_epoch: int
    epochs: int
    initial_valid_loss: float
    best_valid_loss: float


def tensors(split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as float32 rows and the label as float32, as the MLP's loss wants them."""
    import numpy as np
    import torch

    x = torch.tensor(split.features.to_numpy(dtype=np.float32))
    return x, torch.tensor(split.label.astype(np.float32))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights, safe from later optimiser steps."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def fit(
    model: torch.nn.Sequential,
    train: tuple[torch.Tensor, torch.Tensor],
    valid: tuple[torch.Tensor, torch.Tensor],
    params: MlpParams,
    progress: StageProgress,
    saver: TorchCheckpoint | None = None,
) -> FitResult:
    """Mini-batch Adam until valid loss has not improved for ``patience`` epochs.

    ``saver``: where the whole state goes every few epochs (weights, Adam's moments, the RNG, the
    best so far), and the epoch a stopped fit resumes from: the same bytes as a fit never stopped.
    """
    import torch

    optimizer = adam(model, params)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    initial = best = _valid_loss(model, valid, loss_fn)
    result = FitResult(snapshot(model), 0, 0, initial, best)
    found = saver.latest() if saver is not None else None
    done = restore_fit(found, model, optimizer, result) if found is not None else 0
    progress.start(params.max_epochs, unit="epochs", description="mlp")
    progress.advance(done)
    for epoch in range(done + 1, params.max_epochs + 1):
        _train_epoch(model, train, optimizer, loss_fn, params.batch_size)
        loss = _valid_loss(model, valid, loss_fn)
        result.epochs = epoch
        progress.advance(1)
        if loss < result.best_valid_loss:
            result.state, result.best_epoch, result.best_valid_loss = snapshot(model), epoch, loss
        elif epoch - result.best_epoch >= params.patience:
            break
        if saver is not None:
            saver.maybe_save(epoch, lambda: fit_state(model, optimizer, result))
    return result


def adam(model: torch.nn.Module, params: MlpParams) -> torch.optim.Optimizer:
    """Adam, fused: the same bytes whatever the x86-64 CPU (AVX-512, AVX2 and SSE4.2 measured).

    The default (per-tensor) Adam takes the square root of its second moment with ``Tensor.sqrt``,
    which for float32 on CPU is MKL's vector math: not the IEEE square root (653 of 4,099 values
    an ulp off), and its kernel follows the CPU whatever ``MKL_CBWR`` says (an AVX-512 and an AVX2
    machine trained two different MLPs under every pin). The fused kernel is torch's own, with the
    CPU's exact square root: one model on AVX-512, AVX2 and SSE4.2 (tests/tasks/test_mlp_cpus.py).
    """
    import torch

    return torch.optim.Adam(model.parameters(), lr=params.learning_rate, weight_decay=params.weight_decay,
                            fused=True)


def fit_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, result: FitResult) -> dict[str, Any]:
    """All a fit needs to go on after ``result.epochs`` as if it had never stopped."""
    import torch

    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
            "best": result.state, "best_epoch": result.best_epoch, "best_valid_loss": result.best_valid_loss,
            "initial_valid_loss": result.initial_valid_loss}


def restore_fit(found: tuple[int, dict[str, Any]], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             result: FitResult) -> int:
    """Take up a saved fit (:func:`fit_state`); the epochs it had done."""
    import torch

    epoch, state = found
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    result.state, result.best_epoch = state["best"], int(state["best_epoch"])
    result.best_valid_loss = float(state["best_valid_loss"])
    result.initial_valid_loss = float(state["initial_valid_loss"])
    result.epochs = epoch
    return epoch


def _train_epoch(
    model: torch.nn.Sequential,
    data: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    loss_fn: torch.nn.BCEWithLogitsLoss,
    batch_size: int,
) -> None:
    """One pass over the rows in a seeded random order (torch's global RNG, forked)."""
    import torch

    x, y = data
    model.train()
    for batch in torch.split(torch.randperm(len(x)), batch_size):
        optimizer.zero_grad()
        loss_fn(model(x[batch]).squeeze(1), y[batch]).backward()
        optimizer.step()


def _valid_loss(
    model: torch.nn.Sequential,
    data: tuple[torch.Tensor, torch.Tensor],
    loss_fn: torch.nn.BCEWithLogitsLoss,
) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return float(loss_fn(model(data[0]).squeeze(1), data[1]))
