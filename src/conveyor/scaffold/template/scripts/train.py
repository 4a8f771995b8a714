"""Fit a ridge regression on the features; write the model and its test metrics.

A plain script, as any dvc.yaml stage runs: paths and parameters on its command line,
outputs written where it is told. conveyor runs it as the `train` stage (a `cmd`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("features", type=Path)
    parser.add_argument("model", type=Path)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    frame = pd.read_parquet(args.features)
    x, y = frame.drop(columns="y").to_numpy(), frame["y"].to_numpy()
    test = np.random.default_rng(args.seed).random(len(y)) < args.test_fraction
    weights = fit(x[~test], y[~test], args.alpha)
    predicted = x[test] @ weights[1:] + weights[0]
    rmse = float(np.sqrt(np.mean((predicted - y[test]) ** 2)))
    r2 = float(1 - np.sum((predicted - y[test]) ** 2) / np.sum((y[test] - y[test].mean()) ** 2))

    args.model.parent.mkdir(parents=True, exist_ok=True)
    features = [c for c in frame.columns if c != "y"]
    model = {"features": features, "intercept": weights[0], "coef": list(weights[1:])}
    args.model.write_text(json.dumps(model, indent=2) + "\n")
    args.metrics.parent.mkdir(parents=True, exist_ok=True)
    args.metrics.write_text(json.dumps({"r2": round(r2, 6), "rmse": round(rmse, 6), "test_rows": int(test.sum())},
                                       indent=2) + "\n")
    print(f"ridge alpha={args.alpha}: test r2 {r2:.4f}, rmse {rmse:.4f}")


def fit(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Ridge regression in closed form; the intercept (first weight) is not penalised."""
    design = np.column_stack([np.ones(len(x)), x])
    penalty = alpha * np.eye(design.shape[1])
    penalty[0, 0] = 0.0
    weights: np.ndarray = np.linalg.solve(design.T @ design + penalty, design.T @ y)
    return weights


if __name__ == "__main__":
    main()
