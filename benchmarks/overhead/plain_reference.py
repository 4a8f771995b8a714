"""The reference pipeline as one plain script: no orchestrator, no Dask, one process.

``python benchmarks/overhead/plain_reference.py OUTDIR [--project DIR]``: what a data scientist
would write in one file to do the work of ``configs/pipeline.yaml``, with the same
libraries and the project's ``params.yaml`` (``DIR``, default the repository holding this
script). It writes under ``OUTDIR`` the same kinds of outputs the pipeline writes:

- ``data/raw/part-00000.parquet``: the ``ingest.sources`` CSV (scikit-learn's bundled
  breast-cancer file, ``{package:NAME}`` expanded as conveyor's ingest does) read with pandas;
- ``data/processed/{train,valid,test}/part-00000.parquet`` and ``stats.json``: the steps of
  ``tasks/preprocess.py`` done with pandas on one frame instead of dask.dataframe. The
  split and scaling reuse the task's own per-partition helpers (the split keys, cut
  points, tagging, statistics, standardising), so the rows are the pipeline's rows;
- ``models/xgb.json``: ``xgb.train`` in this process (``nthread=2``) with the params of
  ``tasks/train.py:xgboost_model``, early-stopped on valid, cut at its best round;
- ``models/mlp.pt``: the MLP of ``tasks/mlp.py`` trained here, seeded, deterministic kernels;
- ``models/stack.json``: the logistic regression over both models' log-odds, fitted on valid;
- ``metrics/{train_xgb,train_mlp,test}.json`` and ``plots/roc.png``, as the pipeline's.

It also writes ``timings.json``: seconds per step, and which of conveyor, prefect, dask,
distributed the process had imported (none, by design). It never imports them itself:
``tasks.preprocess`` and ``tasks.files`` import conveyor only for type checking.
"""

from __future__ import annotations

import argparse
import importlib.resources
import io
import itertools
import json
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

STARTED = time.perf_counter()

import numpy as np  # noqa: E402 - after STARTED: the imports are part of the script's time
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import xgboost as xgb  # noqa: E402
import yaml  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score  # noqa: E402

if TYPE_CHECKING:
    import numpy.typing as npt

FORBIDDEN = ("conveyor", "prefect", "dask", "distributed")
SPLITS = ("train", "valid", "test")
DIGITS = 6  # as tasks/train.py and tasks/evaluate.py round their metrics
CLIP = 1e-7  # as tasks/models.py clips probabilities before log-odds
PACKAGE_TEMPLATE = re.compile(r"\{package:([A-Za-z0-9_.]+)\}")


class Steps:
    """Seconds per step, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"imports": time.perf_counter() - STARTED}
        self._mark = time.perf_counter()

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self._mark
        self._mark = now


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")


# --- ingest -----------------------------------------------------------------------------


def source_path(url: str) -> Path:
    """A ``file://`` source of params.yaml as a local path, ``{package:NAME}`` expanded."""
    url = PACKAGE_TEMPLATE.sub(lambda m: str(importlib.resources.files(m.group(1))), url)
    if "://" in url and not url.startswith("file://"):
        raise SystemExit(f"plain_reference: only local sources are supported, got {url}")
    return Path(url.removeprefix("file://"))


def ingest(params: Mapping[str, Any], out: Path) -> pd.DataFrame:
    """Every source CSV read whole with pandas, concatenated, written as one parquet part."""
    frames = [pd.read_csv(source_path(str(url)), header=None, names=list(params["columns"]), dtype=params["dtype"],
                          skiprows=int(params["skip_rows"])) for url in params["sources"]]
    raw = pd.concat(frames, ignore_index=True)
    out.mkdir(parents=True)
    raw.to_parquet(out / "part-00000.parquet", index=False)
    return raw


# --- preprocess -------------------------------------------------------------------------


def preprocess(raw: pd.DataFrame, params: Mapping[str, Any], seed: int, out: Path) -> dict[str, pd.DataFrame]:
    """Clean, split (exact, stratified, seeded), fit stats on train, standardise, write the splits."""
    # the project's own pandas helpers (no conveyor, no dask)
    from benchmarks.compute.plain_preprocess import split_frame
    from tasks import preprocess as prep
    from tasks.split import SPLITS as SPLIT_NAMES
    from tasks.split import Fractions

    label = str(params["label"])
    fractions = Fractions(valid=float(params["valid_fraction"]), test=float(params["test_fraction"]))
    frame = raw.dropna(subset=[label])
    if pd.api.types.is_float_dtype(frame[label].dtype):
        frame = frame.astype({label: "int64"})
    split = split_frame(frame, label=label, seed=seed, fractions=fractions, source="data/raw")
    for name in SPLITS:
        (out / name).mkdir(parents=True)
    prep.write_split_parts(split.rows, split.codes, out, "part-00000.parquet", label)
    features = [column for column in frame.columns if column != label]
    write_json(out / "stats.json", prep._summary(label, features, seed, fractions, split.stats, split.class_counts))
    rows = split.rows.to_pandas()
    return {name: rows[split.codes == code] for code, name in enumerate(SPLIT_NAMES)}


# --- the models -------------------------------------------------------------------------


def train_xgb(splits: Mapping[str, pd.DataFrame], features: list[str], label: str, params: Mapping[str, Any],
              seed: int, models: Path, metrics: Path) -> xgb.Booster:
    """``xgb.train`` with early stopping on valid; the booster cut at its best round."""
    booster_params = {**params.get("booster", {}), "objective": "binary:logistic", "eval_metric": "logloss",
                      "device": "cpu", "seed": seed, "nthread": 2}
    dtrain = xgb.DMatrix(splits["train"][features], label=splits["train"][label])
    dvalid = xgb.DMatrix(splits["valid"][features], label=splits["valid"][label])
    history: dict[str, Any] = {}
    booster = xgb.train(booster_params, dtrain, num_boost_round=int(params["num_boost_round"]),
                        evals=[(dvalid, "valid")], early_stopping_rounds=int(params["early_stopping_rounds"]),
                        evals_result=history, verbose_eval=False)
    best = int(booster.best_iteration)
    booster = booster[: best + 1]
    models.mkdir(parents=True, exist_ok=True)
    (models / "xgb.json").write_bytes(bytes(booster.save_raw(raw_format="json")))
    losses = history["valid"]["logloss"]
    write_json(metrics / "train_xgb.json", {"best_iteration": best,
                                            "best_valid_logloss": round(float(losses[best]), DIGITS),
                                            "rounds": len(losses), "n_workers": 1, "device": "cpu"})
    return booster


def build_mlp(sizes: list[int]) -> torch.nn.Sequential:
    """Linear layers with ReLU between them, one logit out (as tasks/models.py builds it)."""
    layers: list[torch.nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def tensors(rows: pd.DataFrame, features: list[str], label: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows[features].to_numpy(dtype=np.float32)),
            torch.tensor(rows[label].to_numpy(dtype=np.float32)))


def valid_loss(model: torch.nn.Sequential, data: tuple[torch.Tensor, torch.Tensor],
               loss_fn: torch.nn.BCEWithLogitsLoss) -> float:
    model.eval()
    with torch.no_grad():
        return float(loss_fn(model(data[0]).squeeze(1), data[1]))


def train_mlp(splits: Mapping[str, pd.DataFrame], features: list[str], label: str, params: Mapping[str, Any],
              seed: int, models: Path, metrics: Path) -> torch.nn.Sequential:
    """Adam on mini-batches, early-stopped on valid loss, best weights kept; seeded, deterministic."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    sizes = [len(features), *(int(n) for n in params["hidden"]), 1]
    model = build_mlp(sizes)
    train, valid = tensors(splits["train"], features, label), tensors(splits["valid"], features, label)
    optimizer = torch.optim.Adam(model.parameters(), lr=float(params["learning_rate"]),  # as tasks.mlp.adam
                                 weight_decay=float(params.get("weight_decay", 0.0)), fused=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    initial = best_loss = valid_loss(model, valid, loss_fn)
    best_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    best_epoch = epochs = 0
    for epoch in range(1, int(params["max_epochs"]) + 1):
        model.train()
        x, y = train
        for batch in torch.split(torch.randperm(len(x)), int(params["batch_size"])):
            optimizer.zero_grad()
            loss_fn(model(x[batch]).squeeze(1), y[batch]).backward()
            optimizer.step()
        loss = valid_loss(model, valid, loss_fn)
        epochs = epoch
        if loss < best_loss:
            best_state, best_epoch, best_loss = ({n: t.detach().clone() for n, t in model.state_dict().items()},
                                                 epoch, loss)
        elif epoch - best_epoch >= int(params["patience"]):
            break
    model.load_state_dict(best_state)
    buffer = io.BytesIO()
    torch.save({"sizes": sizes, "features": features, "state_dict": best_state}, buffer)
    models.mkdir(parents=True, exist_ok=True)
    (models / "mlp.pt").write_bytes(buffer.getvalue())
    write_json(metrics / "train_mlp.json", {"epochs": epochs, "best_epoch": best_epoch,
                                            "initial_valid_loss": round(initial, DIGITS),
                                            "best_valid_loss": round(best_loss, DIGITS)})
    return model.eval()


def base_probabilities(rows: pd.DataFrame, features: list[str], booster: xgb.Booster,
                       mlp: torch.nn.Sequential) -> npt.NDArray[np.float64]:
    """One column per base model (xgb, mlp): P(label = 1)."""
    p_xgb = np.asarray(booster.predict(xgb.DMatrix(rows[features], feature_names=features)), dtype=np.float64)
    with torch.no_grad():
        logits = mlp(torch.tensor(rows[features].to_numpy(dtype=np.float32))).squeeze(1)
    p_mlp = torch.sigmoid(logits).double().numpy()
    return np.column_stack([p_xgb, p_mlp])


def log_odds(probabilities: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    p = np.clip(probabilities, CLIP, 1.0 - CLIP)
    result: npt.NDArray[np.float64] = np.log(p / (1.0 - p))
    return result


def fit_stack(valid: pd.DataFrame, base: npt.NDArray[np.float64], label: str, c: float, seed: int,
              models: Path) -> LogisticRegression:
    """Logistic regression over the base models' log-odds, fitted on valid."""
    fitted = LogisticRegression(C=c, random_state=seed).fit(log_odds(base), valid[label].to_numpy(dtype=np.int64))
    body = {"inputs": ["xgb", "mlp"], "transform": "logit", "coef": [float(w) for w in fitted.coef_[0]],
            "intercept": float(fitted.intercept_[0]), "C": c, "fitted_on": "valid", "rows": len(valid)}
    (models / "stack.json").write_text(json.dumps(body, indent=2) + "\n")
    return fitted


# --- evaluate ---------------------------------------------------------------------------


def evaluate(test: pd.DataFrame, probabilities: Mapping[str, npt.NDArray[np.float64]], label: str,
             threshold: float, metrics: Path, plot: Path) -> None:
    """AUC, accuracy and log-loss of every model on test; their ROC curves to a PNG."""
    y = test[label].to_numpy(dtype=np.int64)
    scores = {name: {"auc": round(float(roc_auc_score(y, p)), DIGITS),
                     "accuracy": round(float(accuracy_score(y, p >= threshold)), DIGITS),
                     "logloss": round(float(log_loss(y, p, labels=[0, 1])), DIGITS)}
              for name, p in probabilities.items()}
    write_json(metrics / "test.json", scores)
    from tasks.evaluate import plot_roc  # the project's own plot (matplotlib only, no conveyor)

    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_roc(plot, y, dict(probabilities))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("outdir", type=Path, help="where to write data/, models/, metrics/, plots/ (must not exist "
                                                  "or be empty)")
    parser.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the project whose params.yaml and tasks/ to use (default: this repository)")
    args = parser.parse_args(argv)
    out: Path = args.outdir.resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty")
    project: Path = args.project.resolve()
    sys.path.insert(0, str(project))
    steps = Steps()
    params: dict[str, Any] = yaml.safe_load((project / "params.yaml").read_text())
    seed = int(params["seed"])
    models, metrics = out / "models", out / "metrics"
    raw = ingest(params["ingest"], out / "data" / "raw")
    steps.done("ingest")
    splits = preprocess(raw, params["preprocess"], seed, out / "data" / "processed")
    label = str(params["preprocess"]["label"])
    features = [column for column in splits["train"].columns if column != label]
    steps.done("preprocess")
    booster = train_xgb(splits, features, label, params["train"]["xgb"], seed, models, metrics)
    steps.done("train_xgb")
    mlp = train_mlp(splits, features, label, params["train"]["mlp"], seed, models, metrics)
    steps.done("train_mlp")
    valid_base = base_probabilities(splits["valid"], features, booster, mlp)
    stack = fit_stack(splits["valid"], valid_base, label, float(params["train"]["stack"]["C"]), seed, models)
    steps.done("stack")
    test_base = base_probabilities(splits["test"], features, booster, mlp)
    probabilities = {"xgb": test_base[:, 0], "mlp": test_base[:, 1],
                     "stack": np.asarray(stack.predict_proba(log_odds(test_base))[:, 1], dtype=np.float64)}
    evaluate(splits["test"], probabilities, label, float(params["evaluate"]["threshold"]), metrics,
             out / "plots" / "roc.png")
    steps.done("evaluate")
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in FORBIDDEN)
    write_json(out / "timings.json", {"steps_s": steps.seconds, "total_s": time.perf_counter() - STARTED,
                                      "forbidden_modules_loaded": loaded})
    return 0


if __name__ == "__main__":
    sys.exit(main())
