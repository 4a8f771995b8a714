"""The MLP under torch DDP, one rank per Dask worker (:func:`conveyor.train.ddp.run_ddp`).

- Data: every rank reads the whole (small) train split and a ``DistributedSampler`` deals
  each rank a disjoint share of one seeded permutation per epoch. Why not each rank its own
  parquet parts: the sampler pads the ranks to equal shares, so all take the same number of
  steps (DDP all-reduces in every backward; a rank with a step more waits forever), and the
  shuffle stays global as in the in-process fit. The price: a rank holds the whole split.
- Same seed on every rank; early stopping on the valid loss all-reduced over the ranks, so
  all stop at the same epoch. Synchronous data parallel: every rank ends with the same
  weights; each returns their SHA-256, and :func:`train` fails unless they, and the file
  rank 0 wrote, agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.train.ddp import DdpError, Rank, run_ddp, weights_sha256
from tasks import models
from tasks.mlp import FitResult, MlpParams, adam, fit_state, restore_fit, snapshot, tensors

if TYPE_CHECKING:
    import logging

    import torch
    from distributed import Client

    from conveyor import StageProgress
    from conveyor.train.torch_checkpoint import TorchCheckpoint


@dataclass(frozen=True)
class DdpJob:
    """What to train: data, where rank 0 writes the model, params, seed."""

    processed: str
    out: str
    params: MlpParams
    seed: int
    saver: TorchCheckpoint | None = None  # rank 0 saves the fit's state there; every rank resumes from it


@dataclass(frozen=True)
class RankResult:
    """What a rank reports: its weights' checksum and the (all-reduced, so shared) losses."""

    rank: int
    device: str
    weights_sha256: str
    epochs: int
    best_epoch: int
    initial_valid_loss: float
    best_valid_loss: float


def train(client: Client, job: DdpJob, *, gpu: bool, progress: StageProgress, log: logging.Logger) -> list[RankResult]:
    """Train with one rank per worker; the ranks' results in rank order, checked to agree."""
    progress.start(job.params.max_epochs, unit="epochs", description="mlp DDP")
    results = run_ddp(client, train_rank, job, gpu=gpu, timeout_s=job.params.collective_timeout_s,
                      progress=progress, log=log)
    _check_agreement(results, Path(job.out))
    return results


def _check_agreement(results: list[RankResult], out: Path) -> None:
    sums = {result.rank: result.weights_sha256 for result in results}
    if len(set(sums.values())) != 1:
        listed = ", ".join(f"rank {rank}: {digest[:12]}" for rank, digest in sums.items())
        raise DdpError(f"ranks ended with different weights ({listed})")
    try:
        written = weights_sha256(models.load_mlp(out)[0].state_dict())
    except FileNotFoundError:
        raise DdpError(f"rank 0 wrote no model at {out}: do all workers see this filesystem?") from None
    if written != results[0].weights_sha256:
        raise DdpError(f"the model file {out} does not hold the weights the ranks agreed on")


# --- on the workers -------------------------------------------------------------------------


@dataclass
class _Shard:
    """A rank's data on its device: all of train (the sampler picks), its rows of valid."""

    x: torch.Tensor
    y: torch.Tensor
    valid_x: torch.Tensor
    valid_y: torch.Tensor


def train_rank(rank: Rank, job: DdpJob) -> RankResult:
    """One rank: the same seeded model everywhere, DDP over the sampler's share, rank 0 saves it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = rank.device()
    processed = Path(job.processed)
    train_split, valid = models.read_split(processed, "train"), models.read_split(processed, "valid")
    features = list(train_split.features.columns)
    sizes = [len(features), *job.params.hidden, 1]
    torch.manual_seed(job.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = models.build_mlp(sizes).to(device)
    wrapped = DistributedDataParallel(model, device_ids=[0] if rank.gpu else None)
    (x, y), (valid_x, valid_y) = tensors(train_split), tensors(valid)
    n, r = rank.world_size, rank.rank
    shard = _Shard(x.to(device), y.to(device), valid_x[r::n].to(device), valid_y[r::n].to(device))
    fit = _fit(rank, job, model, wrapped, shard)
    model.load_state_dict(fit.state)
    if rank.rank == 0:
        models.save_mlp(Path(job.out), model, sizes, features)
    return RankResult(rank.rank, str(device), weights_sha256(model.state_dict()),
                      fit.epochs, fit.best_epoch, fit.initial_valid_loss, fit.best_valid_loss)


def _fit(rank: Rank, job: DdpJob, model: torch.nn.Module, wrapped: torch.nn.Module, shard: _Shard) -> FitResult:
    """Adam over the sampler's share, until the global valid loss stalls for ``patience`` epochs."""
    from torch.utils.data import DistributedSampler, TensorDataset

    params = job.params
    sampler: DistributedSampler[int] = DistributedSampler(
        TensorDataset(shard.x, shard.y), num_replicas=rank.world_size, rank=rank.rank, seed=job.seed
    )
    optimizer = adam(model, params)
    initial = _global_valid_loss(model, shard)
    fit = FitResult(snapshot(model), 0, 0, initial, initial)
    done = _resumed(rank, job, model, optimizer, fit)
    for epoch in range(done + 1, params.max_epochs + 1):
        sampler.set_epoch(epoch)  # the order of an epoch is the seed's and the epoch's: no RNG state to keep
        _train_epoch(rank, job, wrapped, optimizer, shard, list(sampler))
        loss = _global_valid_loss(model, shard)
        fit.epochs = epoch
        if rank.rank == 0:
            rank.advance()
        if loss < fit.best_valid_loss:
            fit.state, fit.best_epoch, fit.best_valid_loss = snapshot(model), epoch, loss
        elif epoch - fit.best_epoch >= params.patience:
            break
        if job.saver is not None and rank.rank == 0:  # every rank holds the same state: rank 0 saves it
            job.saver.maybe_save(epoch, lambda: fit_state(model, optimizer, fit))
    return fit


def _resumed(rank: Rank, job: DdpJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             fit: FitResult) -> int:
    """Every rank takes up the latest save (rank 0's, of the state all ranks shared); the epochs done."""
    found = job.saver.latest() if job.saver is not None else None
    if found is None:
        return 0
    done = restore_fit(found, model, optimizer, fit)
    if rank.rank == 0:
        rank.advance(done)
    return done


def _train_epoch(rank: Rank, job: DdpJob, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 shard: _Shard, rows: list[int]) -> None:
    """Steps over this rank's rows: the same number on every rank (the sampler pads).

    ``batch_size`` is the global batch, split over the ranks; DDP averages the gradients.
    """
    import torch

    loss_fn = torch.nn.BCEWithLogitsLoss()
    per_rank = max(1, job.params.batch_size // rank.world_size)
    wrapped.train()
    for batch in torch.split(torch.tensor(rows, device=shard.x.device), per_rank):
        rank.check()
        if job.params.fail_on_rank == rank.rank:
            raise RuntimeError(f"rank {rank.rank} failing on purpose (train.mlp.fail_on_rank: {rank.rank})")
        optimizer.zero_grad()
        loss_fn(wrapped(shard.x[batch]).squeeze(1), shard.y[batch]).backward()  # all-reduces the gradients
        optimizer.step()


def _global_valid_loss(model: torch.nn.Module, shard: _Shard) -> float:
    """Mean BCE over all of valid: per-rank sums and counts, all-reduced (same value on every rank)."""
    import torch
    import torch.distributed as dist

    model.eval()
    with torch.no_grad():
        total = torch.nn.functional.binary_cross_entropy_with_logits(
            model(shard.valid_x).squeeze(1), shard.valid_y, reduction="sum"
        )
    count = torch.tensor(float(len(shard.valid_y)), dtype=torch.float64, device=total.device)
    sums = torch.stack([total.double(), count])
    dist.all_reduce(sums)
    return float(sums[0] / sums[1])
