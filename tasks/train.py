"""Train: gradient-boosted trees on the Dask cluster, an MLP, and their stack.

All three read the preprocessed splits (written by :mod:`tasks.preprocess`) and save their
model in the formats of :mod:`tasks.models`; each is seeded so a rerun gives the same
bytes. Paths come from the spec: a stage with one dep, out or metrics file finds it with
``ctx.dep()``, ``ctx.out()``, ``ctx.metric()``; the stack names its inputs
(``deps: {data: ..., xgb: ..., mlp: ...}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from conveyor.parquet import read_dask
from conveyor.train.seed import deterministic_torch
from conveyor.train.torch_checkpoint import TorchCheckpoint
from conveyor.train.xgb import train_xgboost
from tasks import inputs, mlp, models
from tasks.files import write_json
from tasks.preprocess import load_stats

if TYPE_CHECKING:
    import dask.dataframe as dd

    from conveyor import StageContext

_DIGITS = 6  # metrics are rounded, so reruns and diffs read the same


def xgboost_model(ctx: StageContext) -> None:
    """Train a booster with ``xgboost.dask`` on the stage's cluster, early-stopped on valid; in
    this process with ``xgb.train`` when the stage has no cluster (placed in process).
    The splits are read (on the workers) with their page checksums verified."""
    params: Mapping[str, Any] = ctx.section("train.xgb")
    processed = ctx.dep()
    stats = load_stats(processed)
    booster_params = xgb_params(params, int(ctx.params["seed"]), gpu=bool(ctx.devices))
    ctx.progress.start(3, unit="steps", description="xgboost.dask" if ctx.client is not None else "xgboost")
    split: dict[str, dd.DataFrame] = {
        name: read_dask(processed / name, columns=[*stats["features"], stats["label"]])
        for name in ("train", "valid")}
    ctx.progress.advance(1)
    with _naming_damaged(ctx):
        trained = train_xgboost(ctx.client, booster_params, split["train"], valid=split["valid"],
                                label=stats["label"], features=stats["features"],
                                num_boost_round=int(params["num_boost_round"]),
                                early_stopping_rounds=int(params["early_stopping_rounds"]))
    ctx.progress.advance(1)
    models.save_xgb(ctx.out(), trained.booster)
    losses = trained.history["valid"]["logloss"]
    write_json(ctx.metric(), {
        "best_iteration": trained.best_iteration,
        "best_valid_logloss": round(float(losses[trained.best_iteration]), _DIGITS),
        "rounds": trained.rounds,
        "n_workers": trained.n_workers,
        "device": booster_params["device"],
    })
    ctx.progress.advance(1)
    ctx.log.info("xgboost: best iteration %d of %d", trained.best_iteration, trained.rounds)


def xgb_params(section: Mapping[str, Any], seed: int, *, gpu: bool = False) -> dict[str, Any]:
    """XGBoost's params for a ``train.xgb`` section: its ``booster`` mapping as it is, and what the task sets."""
    return {**section.get("booster", {}), "objective": "binary:logistic", "eval_metric": "logloss",
            "device": "cuda" if gpu else "cpu", "seed": seed}


def mlp_model(ctx: StageContext) -> None:
    """Train a small MLP with Adam, early-stopped on valid loss, best weights kept.

    With no cluster (``ctx.client`` is None, a stage without ``on:``) it trains in this
    process; on a Dask profile it trains with DDP, one rank per worker, on the workers'
    GPUs when the profile has devices (see :mod:`tasks.mlp_ddp`).
    """
    params = mlp.MlpParams.from_params(ctx.section("train.mlp"))
    if ctx.client is not None:
        _mlp_ddp(ctx, params)
        return
    processed = ctx.dep()
    with _naming_damaged(ctx):
        train, valid = models.read_split(processed, "train"), models.read_split(processed, "valid")
    features = list(train.features.columns)
    sizes = [len(features), *params.hidden, 1]
    saver = _mlp_saver(ctx, params)
    with deterministic_torch(int(ctx.params["seed"])):
        model = models.build_mlp(sizes)
        fit = mlp.fit(model, mlp.tensors(train), mlp.tensors(valid), params, ctx.progress, saver)
    model.load_state_dict(fit.state)
    models.save_mlp(ctx.out(), model, sizes, features)
    _write_mlp_metrics(ctx, fit.epochs, fit.best_epoch, fit.initial_valid_loss, fit.best_valid_loss)


def _mlp_ddp(ctx: StageContext, params: mlp.MlpParams) -> None:
    """DDP on the stage's workers; rank 0 writes the model, every rank agreed on its weights."""
    from conveyor.train.ddp import backend
    from tasks import mlp_ddp

    assert ctx.client is not None
    job = mlp_ddp.DdpJob(processed=str(ctx.dep()), out=str(ctx.out()), params=params, seed=int(ctx.params["seed"]),
                         saver=_mlp_saver(ctx, params))
    ranks = mlp_ddp.train(ctx.client, job, gpu=bool(ctx.devices), progress=ctx.progress, log=ctx.log)
    lead = ranks[0]
    extra = {"world_size": len(ranks), "backend": backend(gpu=bool(ctx.devices))}
    _write_mlp_metrics(ctx, lead.epochs, lead.best_epoch, lead.initial_valid_loss, lead.best_valid_loss, extra)
    ctx.log.info("mlp: %d DDP ranks agree on weights sha256 %s", len(ranks), lead.weights_sha256[:12])


def _mlp_saver(ctx: StageContext, params: mlp.MlpParams) -> TorchCheckpoint:
    """About 30 saves a fit (every 10 epochs of 300) into the stage's checkpoint folder, where a
    stopped run resumes (none outside a run)."""
    return TorchCheckpoint.of(ctx.checkpoint_dir, total=params.max_epochs, unit="epoch",
                              every=max(1, params.max_epochs // 30))


def _write_mlp_metrics(ctx: StageContext, epochs: int, best_epoch: int, initial_valid_loss: float,
                       best_valid_loss: float, extra: Mapping[str, Any] | None = None) -> None:
    write_json(ctx.metric(), {
        "epochs": epochs,
        "best_epoch": best_epoch,
        "initial_valid_loss": round(initial_valid_loss, _DIGITS),
        "best_valid_loss": round(best_valid_loss, _DIGITS),
        **(extra or {}),
    })
    ctx.log.info("mlp: best epoch %d of %d", best_epoch, epochs)


def stack(ctx: StageContext) -> None:
    """Logistic regression over the base models' log-odds, fitted on VALID (not train).

    The base models were fitted on train, so their train predictions are optimistic;
    valid is data neither saw, which keeps the stack's weights honest.
    """
    from sklearn.linear_model import LogisticRegression

    with _naming_damaged(ctx, "data"):
        valid = models.read_split(ctx.dep("data"), "valid")
    probabilities = models.base_probabilities(valid.features, ctx.dep("xgb"), ctx.dep("mlp"))
    c = float(ctx.section("train.stack")["C"])
    fitted = LogisticRegression(C=c, random_state=int(ctx.params["seed"])).fit(
        models.stack_inputs(probabilities), valid.label
    )
    models.save_stack(
        ctx.out(),
        coef=[float(w) for w in fitted.coef_[0]],
        intercept=float(fitted.intercept_[0]),
        extra={"C": c, "fitted_on": "valid", "rows": len(valid.label)},
    )
    ctx.log.info("stack weights %s", dict(zip(models.BASE_MODELS, fitted.coef_[0], strict=True)))


def _naming_damaged(ctx: StageContext, name: str | None = None) -> AbstractContextManager[None]:
    """A damaged part of the preprocessed splits (the dep ``name``) as the bad-data ValueError naming it."""
    processed = ctx.dep(name)
    return inputs.naming_damaged_files(ctx.stage, processed, inputs.declared(ctx, processed), writer="preprocess")
