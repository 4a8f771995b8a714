"""The reference pipeline's work as one plain script: no orchestrator, no Dask, one process.

``plain_reference.py OUTDIR [--project DIR]``: ``configs/pipeline.yaml``'s work with DIR's params.yaml (default: this
repository) and its own pandas and torch helpers, ``xgb.train`` with ``nthread=2``; the outputs under OUTDIR, and
``timings.json``: its seconds and which of conveyor, prefect, dask, distributed it imported (none).
"""

import argparse
import importlib.resources
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

STARTED = time.perf_counter()

import numpy as np  # noqa: E402 - after STARTED: the imports are part of the script's time
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import xgboost as xgb  # noqa: E402
import yaml  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

FORBIDDEN = ("conveyor", "prefect", "dask", "distributed")
DIGITS = 6  # as tasks/train.py rounds its metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args(argv)
    out, project = args.outdir.resolve(), args.project.resolve()
    sys.path.insert(0, str(project))
    from benchmarks.compute.plain_preprocess import split_frame  # the project's own helpers: no conveyor, no dask
    from tasks import mlp, models
    from tasks import preprocess as prep
    from tasks.evaluate import plot_roc, score
    from tasks.files import write_json
    from tasks.split import SPLITS, Fractions
    params: dict[str, Any] = yaml.safe_load((project / "params.yaml").read_text())
    seed, ingest, pre, train = int(params["seed"]), params["ingest"], params["preprocess"], params["train"]
    label = str(pre["label"])
    for folder in ("data/raw", *(f"data/processed/{name}" for name in SPLITS), "models", "metrics", "plots"):
        (out / folder).mkdir(parents=True)
    sources = [re.sub(r"\{package:([A-Za-z0-9_.]+)\}", lambda m: str(importlib.resources.files(m.group(1))), str(url))
               .removeprefix("file://") for url in ingest["sources"]]  # {package:NAME} expanded, local files only
    raw = pd.concat([pd.read_csv(source, header=None, names=list(ingest["columns"]), dtype=ingest["dtype"],
                                 skiprows=int(ingest["skip_rows"])) for source in sources], ignore_index=True)
    raw.to_parquet(out / "data/raw/part-00000.parquet", index=False)
    fractions = Fractions(valid=float(pre["valid_fraction"]), test=float(pre["test_fraction"]))
    frame = cast(pd.DataFrame, prep.clean(cast(Any, raw), label))
    split = split_frame(frame, label=label, seed=seed, fractions=fractions, source="data/raw")
    prep.write_split_parts(split.rows, split.codes, out / "data/processed", "part-00000.parquet", label)
    features = [column for column in frame.columns if column != label]
    write_json(out / "data/processed/stats.json",
               prep._summary(label, features, seed, fractions, split.stats, split.class_counts))
    rows = split.rows.to_pandas()
    parts = {name: models.Split(rows[split.codes == code][features], rows[split.codes == code][label]
                                .to_numpy(dtype=np.int64)) for code, name in enumerate(SPLITS)}
    xp, history = train["xgb"], cast(dict[str, Any], {})
    dmatrix = {name: xgb.DMatrix(parts[name].features, label=parts[name].label) for name in ("train", "valid")}
    booster = xgb.train({**xp.get("booster", {}), "objective": "binary:logistic", "eval_metric": "logloss",
                         "device": "cpu", "seed": seed, "nthread": 2}, dmatrix["train"], verbose_eval=False,
                        num_boost_round=int(xp["num_boost_round"]), evals=[(dmatrix["valid"], "valid")],
                        early_stopping_rounds=int(xp["early_stopping_rounds"]), evals_result=history)
    best, losses = int(booster.best_iteration), history["valid"]["logloss"]
    booster = booster[: best + 1]
    models.save_xgb(out / "models/xgb.json", booster)
    write_json(out / "metrics/train_xgb.json", {"best_iteration": best, "best_valid_logloss": round(
        float(losses[best]), DIGITS), "rounds": len(losses), "n_workers": 1, "device": "cpu"})
    sizes = [len(features), *(mp := mlp.MlpParams.from_params(train["mlp"])).hidden, 1]
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    net = models.build_mlp(sizes)
    silent = SimpleNamespace(start=lambda *_a, **_k: None, advance=lambda *_a: None)  # no progress bar
    fit = mlp.fit(net, mlp.tensors(parts["train"]), mlp.tensors(parts["valid"]), mp, cast(Any, silent))
    net.load_state_dict(fit.state)
    models.save_mlp(out / "models/mlp.pt", net, sizes, features)
    write_json(out / "metrics/train_mlp.json", {"epochs": fit.epochs, "best_epoch": fit.best_epoch, **{
        f"{k}_valid_loss": round(getattr(fit, f"{k}_valid_loss"), DIGITS) for k in ("initial", "best")}})

    def base(part: models.Split) -> Any:  # one column per base model (xgb, mlp): P(label = 1)
        return np.column_stack([models.xgb_probabilities(booster, part.features),
                                models.mlp_probabilities(net.eval(), features, part.features)])
    c, valid = float(train["stack"]["C"]), parts["valid"]
    stack = LogisticRegression(C=c, random_state=seed).fit(models.stack_inputs(base(valid)), valid.label)
    models.save_stack(out / "models/stack.json", [float(w) for w in stack.coef_[0]], float(stack.intercept_[0]),
                      {"C": c, "fitted_on": "valid", "rows": len(valid.label)})
    test, test_base = parts["test"], base(parts["test"])
    probabilities = {"xgb": test_base[:, 0], "mlp": test_base[:, 1],
                     "stack": np.asarray(stack.predict_proba(models.stack_inputs(test_base))[:, 1], dtype=np.float64)}
    write_json(out / "metrics/test.json", {name: score(test.label, p, threshold=float(params["evaluate"]["threshold"]))
                                           for name, p in probabilities.items()})
    plot_roc(out / "plots/roc.png", test.label, probabilities)
    write_json(out / "timings.json", {"total_s": time.perf_counter() - STARTED, "forbidden_modules_loaded": sorted(
        n for n in sys.modules if n.split(".")[0] in FORBIDDEN)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
