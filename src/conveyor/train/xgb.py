"""xgboost.dask on the stage's cluster: one booster trained by every worker, reproducibly.

:func:`train_xgboost` takes dask DataFrames, pins one contiguous range of rows to each
worker in xgboost's rank order, holds the cluster's collective lock while xgboost's
ranks wait on each other, and returns the booster cut at its best round with the
evaluation history. The same seed, data and cluster size give the same booster. With no
client (a stage placed in the runner's process) it is ``xgb.train`` in this process on the
same rows: for data that small, a cluster costs more than the training.

Inside a stage the booster is saved every ``checkpoint_every`` rounds in the stage's checkpoint
folder, and a run killed at round 300 of 500 resumes at 300 with the booster an uninterrupted
run had there (:mod:`conveyor.train.xgb_checkpoint`: one call, or segments where the params
draw at random).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.train.collective import collective_job, within_hold
from conveyor.train.xgb_checkpoint import Rounds

if TYPE_CHECKING:
    import dask.dataframe as dd
    import xgboost as xgb
    from distributed import Client


@dataclass(frozen=True)
class Trained:
    """A booster cut at its best round, and how training went."""

    booster: xgb.Booster
    best_iteration: int
    rounds: int  # boosting rounds run (early stopping ends them before num_boost_round)
    history: Mapping[str, Mapping[str, list[float]]]  # {"valid": {"logloss": [...]}}
    n_workers: int


def train_xgboost(client: Client | None, params: Mapping[str, Any], train: dd.DataFrame, *, label: str,
                  features: Sequence[str] | None = None, valid: dd.DataFrame | None = None,
                  num_boost_round: int = 100, early_stopping_rounds: int | None = None,
                  checkpoint_every: int = 50, checkpoint_dir: Path | None = None) -> Trained:
    """Fit ``params`` (xgboost's own) on ``train``; evaluated and early-stopped on ``valid`` when given.

    ``client`` None: ``xgb.train`` in this process (``nthread`` from ``params``, else every core).
    Every ``checkpoint_every`` rounds (0: never) the booster is saved in ``checkpoint_dir``, by
    default the stage's (``ctx.checkpoint_dir``; none outside a run), and training continues from
    the latest one found there. Params that sample (``subsample``, ``colsample_*``) give a booster
    that depends on ``checkpoint_every``: xgboost draws anew from its seed at each continuation.
    """
    columns = list(features) if features is not None else [c for c in train.columns if c != label]
    rounds = Rounds.open(num_boost_round, early_stopping_rounds if valid is not None else None,
                         checkpoint_every, checkpoint_dir, params)
    if client is None:
        return _train_here(params, train, columns, label, valid, rounds)
    import xgboost as xgb
    import xgboost.collective
    import xgboost.dask

    workers = workers_in_rank_order(client)
    train = pinned(client, train[[*columns, label]], workers)
    evals = []
    dtrain = xgb.dask.DaskDMatrix(client, train[columns], train[label])
    if valid is not None:
        valid = pinned(client, valid[[*columns, label]], workers)
        evals = [(xgb.dask.DaskDMatrix(client, valid[columns], valid[label]), "valid")]
    # the tracker binds the scheduler's host, not whatever address xgboost guesses for this machine
    coll_cfg = xgb.collective.Config(tracker_host_ip=tracker_host(str(getattr(client.scheduler, "address", "") or "")))

    def segment(model: xgb.Booster | None, n: int, callbacks: list[Any]) -> tuple[xgb.Booster, Any]:
        with collective_job(client):
            result = xgb.dask.train(client, dict(params), dtrain, num_boost_round=n, evals=evals,
                                    verbose_eval=False, coll_cfg=coll_cfg, xgb_model=model, callbacks=callbacks)
        return result["booster"], result["history"]

    return _trained(rounds.run(segment), rounds, len(workers))


def _train_here(params: Mapping[str, Any], train: dd.DataFrame, columns: list[str], label: str,
                valid: dd.DataFrame | None, rounds: Rounds) -> Trained:
    """``xgb.train`` on the rows of ``train`` (and ``valid``), computed in this process."""
    import xgboost as xgb
    from dask.base import compute

    frames = compute(train[[*columns, label]], *([valid[[*columns, label]]] if valid is not None else []))
    matrices = [xgb.DMatrix(frame[columns], label=frame[label]) for frame in frames]
    evals = [(matrices[1], "valid")] if valid is not None else []

    def segment(model: xgb.Booster | None, n: int, callbacks: list[Any]) -> tuple[xgb.Booster, Any]:
        history: dict[str, dict[str, list[float]]] = {}
        booster = xgb.train(dict(params), matrices[0], num_boost_round=n, evals=evals, evals_result=history,
                            verbose_eval=False, xgb_model=model, callbacks=callbacks)
        return booster, history

    return _trained(rounds.run(segment), rounds, 1)


def _trained(booster: xgb.Booster, rounds: Rounds, n_workers: int) -> Trained:
    """The booster cut at its best round (the last one without early stopping)."""
    done = booster.num_boosted_rounds()
    best = int(booster.best_iteration) if rounds.early_stopping_rounds else done - 1
    return Trained(booster[: best + 1], best, done, rounds.history, n_workers)


def tracker_host(scheduler_address: str) -> str:
    """Where xgboost's tracker listens: the scheduler's host, which every worker reaches;
    loopback for an in-process cluster (its address names no network at all)."""
    from distributed.comm.addressing import get_address_host

    if not scheduler_address or scheduler_address.startswith("inproc://"):
        return "127.0.0.1"
    return get_address_host(scheduler_address)


def workers_in_rank_order(client: Client) -> list[str]:
    """Worker addresses sorted the way xgboost.dask assigns Rabit ranks.

    xgboost sorts its workers by the task id ``[xgboost.dask-{worker name}]:{address}``;
    LocalCluster names are 0, 1, ... so this order is the same on every run.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    if not info:  # none registered at this instant (one restarting, a cluster still starting): wait for one
        client.wait_for_workers(1, timeout=120)
        info = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(within_hold(info), key=lambda addr: f"[xgboost.dask-{info[addr]['name']}]:{addr}")


def pinned(client: Client, frame: dd.DataFrame, workers: list[str]) -> dd.DataFrame:
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
    for future in futures:
        if future.status == "error":  # its own error (a damaged part names its file): xgboost only asserts
            future.result()
    result: dd.DataFrame = dd.from_delayed(futures, meta=dict(frame.dtypes), verify_meta=False)
    return result
