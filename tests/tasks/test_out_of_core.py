"""Preprocessing data several times larger than the Dask cluster's memory: out of core, no worker lost."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster
from stagebench import StageBench

from tasks import preprocess

N_PARTS, ROWS_PER_PART, N_FEATURES = 90, 100_000, 28
# One worker: a Dask worker process idles at ~250-300 MiB (pandas, pyarrow, dask imported), so
# the memory it can manage is what lies above that; the 3x ratio is to the cluster's total.
N_WORKERS, MEMORY_LIMIT = 1, 640 * 2**20


def write_raw(folder: Path) -> int:
    """HIGGS-shaped parts (28 float features and a 0/1 label); returns the in-memory size in bytes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    total = 0
    for part in range(N_PARTS):
        values = rng.standard_normal((ROWS_PER_PART, N_FEATURES)) * (1 + np.arange(N_FEATURES)) + 3.0
        frame = pd.DataFrame(values, columns=[f"f{i:02d}" for i in range(N_FEATURES)])
        frame["label"] = (values[:, 0] + rng.standard_normal(ROWS_PER_PART) > 3.0).astype("float64")
        frame.to_parquet(folder / f"part-{part:05d}.parquet", index=False)
        total += int(frame.memory_usage(index=False).sum())
    return total


@pytest.mark.slow
@pytest.mark.scale  # about 3 minutes of spilling on 2 cores: out of the default run
def test_preprocess_three_times_the_cluster_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")  # freed Arrow buffers go back to the OS
    size = write_raw(tmp_path / "data/raw")
    assert size >= 3 * N_WORKERS * MEMORY_LIMIT, "the data set must be at least 3x the cluster's memory"
    bench = StageBench(tmp_path, {"seed": 3, "preprocess": {"label": "label", "valid_fraction": 0.1,
                                                             "test_fraction": 0.1}})
    with LocalCluster(n_workers=N_WORKERS, threads_per_worker=1, processes=True, memory_limit=MEMORY_LIMIT,
                      host="127.0.0.1", dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False},
                      local_directory=str(tmp_path / "spill")) as cluster, Client(cluster) as client:
        workers = set(client.scheduler_info(n_workers=-1)["workers"])
        bench.run(preprocess.prepare, params=["preprocess", "seed"], deps=["data/raw"], outs=["data/processed"],
                  client=client)
        assert set(client.scheduler_info(n_workers=-1)["workers"]) == workers, "a worker was killed"

    stats = json.loads((tmp_path / "data/processed/stats.json").read_text())
    assert sum(stats["rows"].values()) == N_PARTS * ROWS_PER_PART
    # Train statistics computed across partitions, out of core, equal pandas on those rows: the
    # standardised train columns have mean 0 and (ddof=1) std 1 when read back whole.
    train = pd.read_parquet(tmp_path / "data/processed/train", columns=["f00", "f27"])
    assert len(train) == stats["rows"]["train"]
    for column in ("f00", "f27"):
        assert train[column].mean() == pytest.approx(0.0, abs=1e-9)
        assert train[column].std() == pytest.approx(1.0, abs=1e-9)
