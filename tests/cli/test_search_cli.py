"""`conveyor search` on the command line: a grid walked once, failed and pruned trials said, usage
errors in one line.

A task stage of a few lines in a project made here; the search needs no Prefect server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FIT = '''
import json


def fit(ctx):
    x = float(ctx.params["fit.x"])
    for epoch in range(5):  # a training's validation loss, falling with the epochs
        ctx.report(epoch, (x - 0.3) ** 2 + 1 / (epoch + 1))
    ctx.out().write_text(f"{x}\\n")
    ctx.metric().parent.mkdir(parents=True, exist_ok=True)
    ctx.metric().write_text(json.dumps({"loss": (x - 0.3) ** 2}))
'''

SPEC = '''
pipeline: cli-search
task_packages: [steps]
profiles:
  one: {kind: threads, max_workers: 1}
stages:
  fit:
    task: steps.fit:fit
    on: one
    params: [fit.x]
    outs: [models/m.txt]
    metrics: [metrics/fit.json]
'''


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for rel, text in {"pyproject.toml": "[project]\nname = 'x'\n", "params.yaml": "fit:\n  x: 0.5\n",
                      "steps/__init__.py": "", "steps/fit.py": FIT, "configs/pipeline.yaml": SPEC}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def search(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["conveyor", "search", "fit", *args], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_a_grid_is_walked_once_however_many_trials_are_asked(root: Path) -> None:
    done = search(root, "-p", "fit.x=choice(0.1,0.2,0.3,0.4)", "--objective", "metrics/fit.json:loss",
                  "--sampler", "grid", "--trials", "10")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "RuntimeError" not in done.stderr, done.stderr
    assert "search fit: 4 trial(s)" in done.stdout and "best: fit@trial-" in done.stdout
    assert "(loss 0); reproduce it in the project with: conveyor run -S fit.x=0.3 fit" in done.stdout, done.stdout


def test_a_search_whose_every_trial_fails_says_why_and_exits_1(root: Path) -> None:
    done = search(root, "-p", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:lost", "--trials", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fit@trial-0 failed: ValueError: metrics/fit.json has no number 'lost' (its numbers: loss)" in done.stderr
    assert "every trial failed: see why in its log (conveyor logs fit@trial-" in done.stderr
    assert "Traceback" not in done.stderr


def test_prune_stops_the_trials_that_fall_behind_on_their_reports(root: Path) -> None:
    args = ["-p", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:loss", "--sampler", "random",
            "--seed", "5", "--trials", "12"]
    done = search(root, *args, "--prune")
    assert done.returncode == 0, done.stderr
    pruned = re.findall(r"^\s+-\s+(fit@trial-\d+)\s+pruned at step (\d) \(it reported ([\d.]+)\)$", done.stdout, re.M)
    ranked = re.findall(r"^\s+\d+\s+(fit@trial-\d+)\s+loss ([\d.e-]+)", done.stdout, re.M)
    assert pruned and len(pruned) + len(ranked) == 12, done.stdout
    assert not (root / ".conveyor/search" / _study(done.stdout) / f"trial-{pruned[0][0].split('-')[-1]}"
                / "models/m.txt").exists()  # a pruned trial's outs go, as a failed stage's
    worst_kept = max(float(loss) for _, loss in ranked)
    assert all(float(reported) > 0.2 for _, _, reported in pruned), (pruned, worst_kept)  # never one near x=0.3

    without = search(root, *args)  # the same search without --prune: another study, every trial run
    assert without.returncode == 0 and "pruned" not in without.stdout, without.stdout
    assert len(re.findall(r"^\s+\d+\s+fit@trial-\d+\s+loss", without.stdout, re.M)) == 12


def _study(stdout: str) -> str:
    return re.findall(r"of study (\S+) ", stdout)[0]


@pytest.mark.parametrize(("args", "said"), [
    (["-p", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:loss", "--sampler", "grdi"],
     "--sampler grdi: unknown sampler (did you mean 'grid'?) (samplers: tpe, random, grid)"),
    (["--objective", "metrics/fit.json:loss"], "say what to search with --param (e.g. --param"),
    (["-p", "fit.x=uniform(0,1)"], "say what to optimise with --objective FILE:KEY"),
])
def test_usage_errors_are_one_line_and_exit_2(root: Path, args: list[str], said: str) -> None:
    done = search(root, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    assert not (root / ".conveyor/search").exists()


def test_without_optuna_the_search_says_how_to_install_it(root: Path) -> None:
    """`pip install -e .[cpu]` has no Optuna: one line naming the extra, exit 2, no trial."""
    hidden = ("import sys; sys.modules['optuna'] = None; "  # what Python does for a missing module
              "sys.argv = ['conveyor', 'search', 'fit', '-p', 'fit.x=uniform(0,1)', "
              "'--objective', 'metrics/fit.json:loss']; from conveyor.cli.app import main; main()")
    done = subprocess.run([sys.executable, "-c", hidden], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == ("conveyor search proposes trials with Optuna, which is not installed here: "
                           "pip install 'conveyor[search]' (or pip install optuna)\n"), done.stderr
    assert not (root / ".conveyor/search").exists()
