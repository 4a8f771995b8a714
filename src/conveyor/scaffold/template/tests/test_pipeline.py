"""The project's tests: its stages' own functions, and the whole pipeline run by conveyor."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
from tasks.features import standardise

ROOT = Path(__file__).resolve().parents[1]


def test_standardise_centres_and_scales_the_features() -> None:
    frame = dd.from_pandas(pd.DataFrame({"x0": [1.0, 2.0, 3.0], "y": [5.0, 6.0, 7.0]}), npartitions=1)
    scaled = standardise(frame, frame[["x0"]].mean().compute(), frame[["x0"]].std().compute()).compute()
    assert scaled["x0"].tolist() == [-1.0, 0.0, 1.0]
    assert scaled["y"].tolist() == [5.0, 6.0, 7.0]


def test_the_pipeline_runs_and_learns(tmp_path: Path) -> None:
    """`conveyor run` on a copy of the project: every stage succeeds and the model fits the data."""
    for name in ("configs", "tasks", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("params.yaml", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)

    done = subprocess.run(["conveyor", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "metrics/train.json").read_text())["r2"] > 0.95
    again = subprocess.run(["conveyor", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    record = json.loads((tmp_path / ".conveyor/runs/latest.json").read_text())
    assert again.returncode == 0 and {s["status"] for s in record["stages"].values()} == {"skipped"}

    # the model section: the trained model scores raw rows in batch (one worker, started and stopped)
    scored = subprocess.run(["conveyor", "predict", "-i", "data/raw.csv", "-o", "predictions.parquet",
                             "--allow-extra", "--workers", "1"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    raw = pd.read_csv(tmp_path / "data/raw.csv")
    predictions = pd.read_parquet(tmp_path / "predictions.parquet")
    assert len(predictions) == len(raw)
    assert ((predictions["score"] - raw["y"]) ** 2).mean() < 0.1 * raw["y"].var()
