"""The reference pipeline (configs/pipeline.yaml) run as a user runs it, three times."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, Project


@pytest.mark.slow
def test_reference_pipeline_runs_skips_and_reproduces(reference_project: Project) -> None:
    project = reference_project
    first = project.conveyor("run")
    assert first.returncode == 0, first.stderr[-3000:]
    for noise in ("got rank", "distributed.", "Task run", "Traceback"):  # xgboost, Dask, Prefect: in the logs
        assert noise not in first.stdout + first.stderr, noise
    record = project.record()
    assert {n: s["status"] for n, s in record["stages"].items()} == dict.fromkeys(
        ["ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate"], "succeeded")
    metrics = json.loads((project.root / "metrics/test.json").read_text())
    assert metrics["stack"]["auc"] >= 0.97
    assert set(metrics) >= {"xgb", "mlp", "stack"}
    assert (project.root / "plots/roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["stages"]["ingest"]["profile"] == "io"
    assert record["stages"]["preprocess"]["profile"] == "cpu"
    if record["stages"]["train_xgb"]["profile"] == "cpu":  # no GPU here: the declared fallback
        assert "no GPU visible: profile 'gpu' falls back to 'cpu'" in first.stderr
    assert not project.left_running()

    second = project.conveyor("run")
    assert second.returncode == 0
    assert {s["status"] for s in project.record()["stages"].values()} == {"skipped"}
    assert second.stderr.count("up to date") >= 6

    forced = project.conveyor("run", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert {s["status"] for s in project.record()["stages"].values()} == {"succeeded"}
    assert json.loads((project.root / "metrics/test.json").read_text()) == metrics


@pytest.mark.slow
def test_a_fresh_clone_first_run_leaves_git_clean(tmp_path: Path, prefect_server: dict[str, str]) -> None:
    """The committed dvc.lock records what a run on another machine produces (README, first command)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = {**os.environ, **prefect_server}
    run = subprocess.run(["conveyor", "run"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "out missing: data/raw" in run.stderr  # a fresh clone has no outs: said in plain words
    changed = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert changed.stdout == "", changed.stdout
    status = subprocess.run(["dvc", "status"], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
