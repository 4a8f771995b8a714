"""The synthetic source: HIGGS-shaped shards, seeded, generated on the pool, learnable."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pytest
from distributed import Client
from stagebench import REPO, StageBench

from conveyor.ingest import synthetic
from tasks import ingest, preprocess

T = TypeVar("T")


class CountingExecutor(ThreadPoolExecutor):
    """A real thread pool that counts what it was given."""

    submitted = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def run_synthetic(bench: StageBench, executor: Executor | None = None, **source: Any) -> list[Path]:
    """Ingest one synthetic source into bench's data/raw; its parts, in order."""
    spec = {"kind": "synthetic", **source}
    bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], executor=executor,
              overrides={"ingest": {"sources": [spec]}})
    return sorted((bench.root / "data/raw").glob("part-*.parquet"))


def frame(parts: list[Path]) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(part) for part in parts], ignore_index=True)


def test_same_seed_same_bytes_other_seed_other_data(tmp_path: Path) -> None:
    runs = [run_synthetic(StageBench(tmp_path / name, {"ingest": {}}), rows=5000, shards=3, seed=seed)
            for name, seed in (("a", 7), ("b", 7), ("c", 8))]

    assert [p.read_bytes() for p in runs[0]] == [p.read_bytes() for p in runs[1]]
    assert [p.read_bytes() for p in runs[0]] != [p.read_bytes() for p in runs[2]]


def test_shards_rows_columns_and_label_balance(bench: StageBench) -> None:
    with CountingExecutor(max_workers=4) as pool:
        parts = run_synthetic(bench, pool, rows=40_001, shards=4, seed=1)

    assert [p.name for p in parts] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert [len(pd.read_parquet(p)) for p in parts] == [10_001, 10_000, 10_000, 10_000]
    assert pool.submitted == 4  # one task per shard, on the stage's pool
    data = frame(parts)
    assert list(data.columns) == ["target", *synthetic.FEATURES] and len(synthetic.FEATURES) == 28
    assert data["target"].dtype == "int64" and set(data["target"].unique()) == {0, 1}
    assert (data[synthetic.FEATURES].dtypes == "float32").all()
    assert 0.4 < data["target"].mean() < 0.6
    assert data.notna().all().all()
    progress = bench.contexts[-1].progress
    assert progress.description.startswith("4/4 shards, ") and progress.unit == "MB"
    assert progress.completed == pytest.approx(progress.total)


def test_label_is_learnable(bench: StageBench) -> None:
    """A logistic regression beats chance clearly; the nonlinear part leaves room for better models."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    data = frame(run_synthetic(bench, rows=20_000, shards=2, seed=3))
    x, y = data[synthetic.FEATURES], data["target"]
    model = LogisticRegression(max_iter=1000).fit(x[:15_000], y[:15_000])

    assert roc_auc_score(y[15_000:], model.predict_proba(x[15_000:])[:, 1]) > 0.6


def test_bad_synthetic_params_are_reported_together(bench: StageBench) -> None:
    with pytest.raises(ValueError, match=r"2 problem\(s\) in the ingest params:\n.*sources\.0: synthetic source: "
                                         r"unknown keys \['row'\].*\n.*sources\.1: .*need rows >= 1"):
        bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], overrides={"ingest": {"sources": [
            {"kind": "synthetic", "row": 10, "shards": 2, "seed": 1},
            {"kind": "synthetic", "rows": 0, "shards": 2, "seed": 1},
        ]}})


def test_scale_params_drive_ingest_under_their_own_key(bench: StageBench) -> None:
    """configs/scale.yaml declares `scale.ingest`: the task finds its params there."""
    source = bench.params["scale"]["ingest"]["sources"][0]
    assert source["kind"] == "synthetic" and source["rows"] == 2_000_000 and source["shards"] == 16

    small = {"sources": [{**source, "rows": 1600}]}
    bench.run(ingest.fetch, params=["scale.ingest"], outs=["data/raw"], overrides={"scale.ingest": small})

    assert len(list((bench.root / "data/raw").glob("part-*.parquet"))) == 16


def test_scale_spec_is_the_reference_pipeline_on_synthetic_data() -> None:
    from conveyor.spec.project import load_project

    scale, reference = (load_project(REPO / "configs" / name) for name in ("scale.yaml", "pipeline.yaml"))

    assert scale.stage_params("ingest") == {"scale.ingest": scale.params["scale"]["ingest"]}
    assert scale.order == reference.order and scale.graph == reference.graph

    def own(path: str) -> str:  # data/raw -> data/scale/raw: the same layout under its own folders
        top, _, rest = path.partition("/")
        return f"{top}/scale/{rest}"

    for name, stage in scale.pipeline.stages.items():
        ref = reference.pipeline.stages[name]
        assert (stage.task, stage.names.keys()) == (ref.task, ref.names.keys())
        assert (stage.deps, stage.outs, stage.metrics) == tuple(
            tuple(map(own, paths)) for paths in (ref.deps, ref.outs, ref.metrics))


@pytest.mark.slow
def test_preprocess_reads_synthetic_parts(bench: StageBench, client: Client) -> None:
    """The reference preprocess stage splits and standardises the synthetic data as is."""
    run_synthetic(bench, rows=20_000, shards=4, seed=5)
    bench.run(preprocess.prepare, params=["preprocess", "seed"], deps=["data/raw"], outs=["data/processed"],
              client=client)

    stats = bench.json("data/processed/stats.json")
    assert stats["label"] == "target" and stats["features"] == synthetic.FEATURES
    assert sum(stats["rows"].values()) == 20_000
