"""train_xgboost on the session's 2-worker Dask cluster resumes a checkpoint to the very booster of an
uninterrupted run: with sampling (segments, saved by the client) and without (one call per run,
saved by rank 0 on its worker).

A run stopped at round 120 of 200 is stood in for by a run of 120 rounds whose checkpoint then says
"120 of 200": without early stopping, and with segments aligned on ``checkpoint_every``, its booster
is the first 120 rounds of the 200-round run's (as the uninterrupted run shows).
"""

from __future__ import annotations

import json
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conveyor.run.checkpoints import Checkpoint
from conveyor.run.stage import current_client
from conveyor.train.xgb import train_xgboost

pytestmark = pytest.mark.slow


def frame() -> dd.DataFrame:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 10))
    rows = pd.DataFrame(x, columns=[f"x{i}" for i in range(10)])
    rows["y"] = (x[:, 0] + x[:, 1] * x[:, 2] + rng.normal(size=len(x)) > 0).astype(int)
    return dd.from_pandas(rows, npartitions=4)


@pytest.mark.parametrize("subsample", [1.0, 0.8], ids=["one-call", "segments"])
def test_a_resumed_training_on_workers_ends_with_the_uninterrupted_booster(client: Client, tmp_path: Path,
                                                                             subsample: float) -> None:
    data = frame()
    params = {"tree_method": "hist", "max_depth": 4, "eta": 0.1, "objective": "binary:logistic",
              "subsample": subsample, "seed": 1}

    def train(rounds: int, folder: Path) -> bytes:
        with current_client(client):  # as the runner calls a task: the stage's client computes its frames
            trained = train_xgboost(client, params, data, label="y", valid=data, num_boost_round=rounds,
                                    early_stopping_rounds=rounds, checkpoint_every=20, checkpoint_dir=folder)
        assert trained.rounds == rounds
        return bytes(trained.booster.save_raw("ubj"))

    whole = train(200, tmp_path / "whole")
    stopped = tmp_path / "stopped"
    train(120, stopped)
    saved = json.loads((stopped / "progress.json").read_text())
    Checkpoint(stopped, "stopped").mark(120, 200, "round", state=saved["state"])  # as if stopped at 120 of 200
    assert train(200, stopped) == whole
    assert json.loads((stopped / "progress.json").read_text())["step"] == 200
    assert sorted(p.name for p in stopped.iterdir()) == ["progress.json", "xgboost-000200.ubj"]
