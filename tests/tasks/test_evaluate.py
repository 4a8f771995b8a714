"""Evaluate and the whole chain: test metrics, the ROC plot, and byte-identical reruns."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import Client
from stagebench import StageBench, new_cluster, run_chain

COMPARED = [
    "metrics/test.json",
    "metrics/train_xgb.json",
    "metrics/train_mlp.json",
    "data/processed/stats.json",
    "models/xgb.json",
    "models/mlp.pt",
    "models/stack.json",
]


def test_stack_scores_at_least_097_auc_on_test(chain: StageBench) -> None:
    metrics = chain.json("metrics/test.json")

    assert set(metrics) == {"xgb", "mlp", "stack"}
    for scores in metrics.values():
        assert set(scores) == {"auc", "accuracy", "logloss"}
        assert all(value == round(value, 6) for value in scores.values())
    assert metrics["stack"]["auc"] >= 0.97
    assert metrics["stack"]["accuracy"] >= 0.9


def test_roc_plot_is_a_png(chain: StageBench) -> None:
    image = (chain.root / "plots/roc.png").read_bytes()

    assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 10_000


def test_rerun_on_a_fresh_cluster_gives_identical_bytes(
    chain: StageBench, tmp_path: Path, params: dict[str, object]
) -> None:
    """Same seed, new cluster (new worker ports, new partition placement): same outputs."""
    with new_cluster() as cluster, Client(cluster, set_as_default=False) as client:
        again = run_chain(StageBench(tmp_path, dict(params)), client)

    for rel in COMPARED:
        assert (again.root / rel).read_bytes() == (chain.root / rel).read_bytes(), rel


@pytest.mark.parametrize("task", ["fetch", "prepare", "xgboost_model", "mlp_model"])
def test_long_stages_report_progress(chain: StageBench, task: str) -> None:
    progress = next(ctx.progress for ctx in chain.contexts if ctx.stage == task)

    assert progress.total is not None and 0 < progress.completed <= progress.total
