"""Train: gradient-boosted trees on the Dask cluster, an MLP, and their stack.

All three read ``data/processed`` (written by :mod:`tasks.preprocess`) and save their model
in the formats of :mod:`tasks.models`; each is seeded so a rerun gives the same bytes.
The MLP trains in-process when its stage has no cluster, and with torch
DistributedDataParallel, one rank per Dask worker (:mod:`conveyor.train.ddp`), when it has one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks import models
from tasks.files import out_file, write_json
from tasks.preprocess import load_stats

if TYPE_CHECKING:
    import dask.dataframe as dd
    import torch
    from distributed import Client

    from conveyor.run.context import StageContext, StageProgress

_DIGITS = 6  # metrics are rounded, so reruns and diffs read the same
COLLECTIVE_LOCK = "conveyor-collective"  # see collective_job


# --- xgboost on Dask -------------------------------------------------------------------


def xgboost_model(ctx: StageContext) -> None:
    """Train a booster with ``xgboost.dask`` on the stage's cluster, early-stopped on valid."""
    with _dask_client(ctx.client) as client:
        booster, summary = _train_xgb(ctx, client)
    models.save_xgb(out_file(ctx.out("models/xgb.json")), booster)
    write_json(ctx.out("metrics/train_xgb.json"), summary)
    ctx.log.info("xgboost: best iteration %d of %d", summary["best_iteration"], summary["rounds"])


def _train_xgb(ctx: StageContext, client: Client) -> tuple[Any, dict[str, Any]]:
    """Fit on the cluster; the booster cut at its best round, and the training metrics."""
    import xgboost as xgb
    import xgboost.dask

    params: Mapping[str, Any] = ctx.section("train.xgb")
    processed = ctx.dep("data/processed")
    stats = load_stats(processed)
    workers = _workers_in_rank_order(client)
    ctx.progress.start(3, unit="steps", description="xgboost")
    train, valid = (_pinned(client, _read(processed, split, stats), workers) for split in ("train", "valid"))
    dtrain = xgb.dask.DaskDMatrix(client, train[stats["features"]], train[stats["label"]])
    dvalid = xgb.dask.DaskDMatrix(client, valid[stats["features"]], valid[stats["label"]])
    ctx.progress.advance(1)
    booster_params = _booster_params(params, seed=int(ctx.params["seed"]), gpu=bool(ctx.devices))
    with collective_job(client):
        result = xgb.dask.train(
            client,
            booster_params,
            dtrain,
            num_boost_round=int(params["num_boost_round"]),
            evals=[(dvalid, "valid")],
            early_stopping_rounds=int(params["early_stopping_rounds"]),
            verbose_eval=False,
        )
    ctx.progress.advance(1)
    booster, losses = result["booster"], result["history"]["valid"]["logloss"]
    best = int(booster.best_iteration)
    summary = {
        "best_iteration": best,
        "best_valid_logloss": round(float(losses[best]), _DIGITS),
        "rounds": len(losses),
        "n_workers": len(workers),
        "device": booster_params["device"],
    }
    ctx.progress.advance(1)
    return booster[: best + 1], summary


def _booster_params(params: Mapping[str, Any], *, seed: int, gpu: bool) -> dict[str, Any]:
    """params.yaml's ``booster`` settings, with what this task decides: objective, device, seed."""
    return {
        **params.get("booster", {}),
        "objective": "binary:logistic",
        "eval_metric": "logloss",
        "device": "cuda" if gpu else "cpu",
        "seed": seed,
    }


def _read(processed: Path, split: str, stats: Mapping[str, Any]) -> dd.DataFrame:
    import dask.dataframe as dd

    frame: dd.DataFrame = dd.read_parquet(str(processed / split), columns=[*stats["features"], stats["label"]])
    return frame


def _workers_in_rank_order(client: Client) -> list[str]:
    """Worker addresses sorted the way xgboost.dask assigns Rabit ranks.

    xgboost sorts its workers by the task id ``[xgboost.dask-{worker name}]:{address}``;
    LocalCluster names are 0, 1, ... so this order is the same on every run.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(info, key=lambda addr: f"[xgboost.dask-{info[addr]['name']}]:{addr}")


def _pinned(client: Client, frame: dd.DataFrame, workers: list[str]) -> dd.DataFrame:
    """``frame`` as one partition per worker, partition i held by the worker of rank i.

    Why: xgboost.dask trains each worker on the partitions it happens to hold, so the
    quantile sketch merge and the order of histogram sums can depend on which rows went to
    which rank, and left to the scheduler that is decided by timing. (Measured with
    xgboost 3.2 hist on CPU: every placement we tried gave the same booster; xgboost does
    not promise that, e.g. on GPUs.) Pinning a fixed, contiguous range of rows to each rank
    removes the question. It also makes features and label one materialised frame:
    projected separately, dask-expr may fuse the narrow label read into fewer partitions
    (12 feature partitions vs 3 label partitions), which xgboost rejects.
    """
    import dask.dataframe as dd
    from distributed import wait

    parts = frame.repartition(npartitions=len(workers)).to_delayed()
    futures = [
        client.compute(part, workers=[worker], allow_other_workers=False)
        for part, worker in zip(parts, workers, strict=True)
    ]
    wait(futures)
    pinned: dd.DataFrame = dd.from_delayed(futures, meta=dict(frame.dtypes), verify_meta=False)
    return pinned


@contextmanager
def collective_job(client: Client) -> Iterator[None]:
    """Hold the cluster's lock for jobs whose tasks wait on each other (xgboost.dask, DDP).

    Each such job runs one task per worker, and each task blocks until all of them run.
    Two jobs at once on workers with one thread each can deadlock: worker A runs job 1's
    task, worker B job 2's, and each waits for a thread the other holds. The lock lives
    on the scheduler, so it also serialises jobs of other runs sharing the cluster.
    """
    from distributed import Lock

    with Lock(COLLECTIVE_LOCK, scheduler_rpc=client.scheduler, loop=client.loop):
        yield


@contextmanager
def _dask_client(client: Client | None) -> Iterator[Client]:
    """The stage's client, or a small in-process cluster for the duration of the call.

    The private client is made current for this thread only, as the runner does with its
    own: not the process-wide default, so other stages of this process keep theirs.
    """
    if client is not None:
        yield client
        return
    from distributed import Client, LocalCluster

    with (
        # no dashboard, and its HTTP server on a free port rather than 8787
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            dashboard_address=":0",
            scheduler_kwargs={"dashboard": False},
        ) as cluster,
        Client(cluster, set_as_default=False) as own,
        own.as_current(),
    ):
        yield own


# --- MLP with torch --------------------------------------------------------------------


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


def mlp_model(ctx: StageContext) -> None:
    """Train a small MLP with Adam, early-stopped on valid loss, best weights kept.

    With no cluster (``ctx.client`` is None, a stage without ``on:``) it trains in this
    process; on a Dask profile it trains with DDP, one rank per worker, on the workers'
    GPUs when the profile has devices (see :mod:`conveyor.train.ddp`).
    """
    params = MlpParams.from_params(ctx.section("train.mlp"))
    if ctx.client is not None:
        _mlp_ddp(ctx, ctx.client, params)
        return
    import torch

    processed = ctx.dep("data/processed")
    train, valid = models.read_split(processed, "train"), models.read_split(processed, "valid")
    features = list(train.features.columns)
    sizes = [len(features), *params.hidden, 1]
    with torch.random.fork_rng(devices=[]), deterministic_torch():
        torch.manual_seed(int(ctx.params["seed"]))
        model = models.build_mlp(sizes)
        fit = _fit_mlp(model, tensors(train), tensors(valid), params, ctx.progress)
    model.load_state_dict(fit.state)
    models.save_mlp(out_file(ctx.out("models/mlp.pt")), model, sizes, features)
    _write_mlp_metrics(ctx, fit.epochs, fit.best_epoch, fit.initial_valid_loss, fit.best_valid_loss)


def _mlp_ddp(ctx: StageContext, client: Client, params: MlpParams) -> None:
    """DDP on the stage's workers; rank 0 writes the model, every rank agreed on its weights."""
    from conveyor.train import ddp

    job = ddp.DdpJob(
        processed=str(ctx.dep("data/processed")),
        out=str(out_file(ctx.out("models/mlp.pt"))),
        params=params,
        seed=int(ctx.params["seed"]),
        gpu=bool(ctx.devices),
    )
    ranks = ddp.train_on_workers(client, job, progress=ctx.progress, log=ctx.log)
    lead = ranks[0]
    extra = {"world_size": len(ranks), "backend": ddp.backend(gpu=job.gpu)}
    _write_mlp_metrics(ctx, lead.epochs, lead.best_epoch, lead.initial_valid_loss, lead.best_valid_loss, extra)
    ctx.log.info("mlp: %d DDP ranks agree on weights sha256 %s", len(ranks), lead.weights_sha256[:12])


def _write_mlp_metrics(
    ctx: StageContext,
    epochs: int,
    best_epoch: int,
    initial_valid_loss: float,
    best_valid_loss: float,
    extra: Mapping[str, Any] | None = None,
) -> None:
    write_json(
        ctx.out("metrics/train_mlp.json"),
        {
            "epochs": epochs,
            "best_epoch": best_epoch,
            "initial_valid_loss": round(initial_valid_loss, _DIGITS),
            "best_valid_loss": round(best_valid_loss, _DIGITS),
            **(extra or {}),
        },
    )
    ctx.log.info("mlp: best epoch %d of %d", best_epoch, epochs)


@contextmanager
def deterministic_torch(*, warn_only: bool = False) -> Iterator[None]:
    """Deterministic torch kernels for the duration of the call (a process-wide switch).

    ``warn_only``: ops without a deterministic kernel warn instead of raising (on GPUs,
    where cuBLAS may have been set up before ``CUBLAS_WORKSPACE_CONFIG`` was).
    """
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


def tensors(split: models.Split) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as float32 rows and the label as float32, as the MLP's loss wants them."""
    import numpy as np
    import torch

    x = torch.tensor(split.features.to_numpy(dtype=np.float32))
    return x, torch.tensor(split.label.astype(np.float32))


def _fit_mlp(
    model: torch.nn.Sequential,
    train: tuple[torch.Tensor, torch.Tensor],
    valid: tuple[torch.Tensor, torch.Tensor],
    params: MlpParams,
    progress: StageProgress,
) -> FitResult:
    """Mini-batch Adam until valid loss has not improved for ``patience`` epochs."""
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=params.learning_rate, weight_decay=params.weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    initial = best = _valid_loss(model, valid, loss_fn)
    result = FitResult(snapshot(model), 0, 0, initial, best)
    progress.start(params.max_epochs, unit="epochs", description="mlp")
    for epoch in range(1, params.max_epochs + 1):
        _train_epoch(model, train, optimizer, loss_fn, params.batch_size)
        loss = _valid_loss(model, valid, loss_fn)
        result.epochs = epoch
        progress.advance(1)
        if loss < result.best_valid_loss:
            result.state, result.best_epoch, result.best_valid_loss = snapshot(model), epoch, loss
        elif epoch - result.best_epoch >= params.patience:
            break
    return result


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


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights, safe from later optimiser steps."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# --- stack -----------------------------------------------------------------------------


def stack(ctx: StageContext) -> None:
    """Logistic regression over the base models' log-odds, fitted on VALID (not train).

    The base models were fitted on train, so their train predictions are optimistic;
    valid is data neither saw, which keeps the stack's weights honest.
    """
    from sklearn.linear_model import LogisticRegression

    processed = ctx.dep("data/processed")
    valid = models.read_split(processed, "valid")
    probabilities = models.base_probabilities(valid.features, ctx.dep("models/xgb.json"), ctx.dep("models/mlp.pt"))
    c = float(ctx.section("train.stack")["C"])
    fitted = LogisticRegression(C=c, random_state=int(ctx.params["seed"])).fit(
        models.stack_inputs(probabilities), valid.label
    )
    models.save_stack(
        out_file(ctx.out("models/stack.json")),
        coef=[float(w) for w in fitted.coef_[0]],
        intercept=float(fitted.intercept_[0]),
        extra={"C": c, "fitted_on": "valid", "rows": len(valid.label)},
    )
    ctx.log.info("stack weights %s", dict(zip(models.BASE_MODELS, fitted.coef_[0], strict=True)))
