"""The reference pipeline run as a user runs it: a fresh clone of this repository, four runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kernels import KERNEL_PATHS
from projects import FirstRun


@pytest.mark.slow
def test_a_fresh_clone_runs_leaves_git_clean_skips_and_reproduces(
        first_run: FirstRun, tmp_path: Path, prefect_server: dict[str, str]) -> None:
    first = first_run  # `git clone` of this repository (dvc.yaml and dvc.lock included), its first `conveyor run`
    assert first.returncode == 0, first.stderr[-3000:]
    for noise in ("got rank", "distributed.", "Task run", "Traceback"):  # xgboost, Dask, Prefect: in the logs
        assert noise not in first.stdout + first.stderr, noise
    assert "out missing: data/raw" in first.stderr  # a fresh clone has no outs: said in plain words
    assert first.left_running == []
    project = first.copy(tmp_path / "clone", prefect_server)
    # the committed dvc.lock is what a run on another machine produces (README, first command)
    assert project.sh("git", "status", "--porcelain").stdout == ""
    assert "Data and pipelines are up to date" in project.sh("dvc", "status").stdout

    record = project.record()
    assert {n: s["status"] for n, s in record["stages"].items()} == dict.fromkeys(
        ["ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate"], "succeeded")
    metrics = json.loads((project.root / "metrics/test.json").read_text())
    assert metrics["stack"]["auc"] >= 0.97
    assert set(metrics) >= {"xgb", "mlp", "stack"}
    assert record["stages"]["evaluate"]["metrics"]["stack.auc"] == metrics["stack"]["auc"]
    assert (project.root / "plots/roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["stages"]["ingest"]["profile"] == "io"
    assert record["stages"]["preprocess"]["profile"] == "cpu"
    if record["stages"]["train_xgb"]["profile"] == "cpu":  # no GPU here: the declared fallback
        assert "no GPU visible: profile 'gpu' falls back to 'cpu'" in first.stderr

    second = project.conveyor("run")
    assert second.returncode == 0
    assert {s["status"] for s in project.record()["stages"].values()} == {"skipped"}
    assert second.stdout.count("up to date") >= 6

    # the same bytes on two other machines: an AVX2-only CPU's kernel paths, then a baseline
    # x86-64 with one core (the deterministic stages pin theirs; the others do not depend on them)
    for name, kernels in KERNEL_PATHS.items():  # each its own environment, run once: cold, and no runner kept for it
        forced = project.conveyor("run", "--force", env={**kernels, "CONVEYOR_WARM": "0"})
        assert forced.returncode == 0, forced.stderr[-3000:]
        assert {s["status"] for s in project.record()["stages"].values()} == {"succeeded"}
        assert json.loads((project.root / "metrics/test.json").read_text()) == metrics, name
        assert project.sh("git", "status", "--porcelain").stdout == "", name  # reproduced byte for byte
