"""deterministic: the reference MLP trained with the pinned kernel paths vs with the machine's own.

What ``deterministic: true`` costs (issue 35): its process runs torch's baseline kernels, MKL's compatible
path and one thread (:mod:`conveyor.run.determinism`). Both sides run ``tasks.train:mlp_model`` in a fresh
process (``training.side_main``, imports before the clock) with params.yaml's ``train.mlp`` on the reference
splits (``benchmarks/overhead/plain_reference.py``, not timed): in this environment vs with ``pinned_environ``
over it. Checked: each side writes the same weights on every repetition; the candidate ran torch's DEFAULT
capability with one thread. Goal: at most 1.3x the baseline's training wall.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from benchmarks.compute.training import measure
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met
from benchmarks.projects import SideRun, cli, repo_env

NAME = "deterministic"
DESCRIPTION = "the reference MLP with deterministic: true's pinned kernels and one thread vs the machine's own"
GOAL = 1.3  # the candidate's training wall at most this many times the baseline's


def run(config: Config, log: Callable[[str], None]) -> Result:
    from conveyor.run.determinism import pinned_environ

    repeats, machine = config.reps(7, 2), repo_env()
    reference = yaml.safe_load((REPO / "params.yaml").read_text())
    params = {"train.mlp": reference["train"]["mlp"], "seed": reference["seed"]}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-deterministic-") as tmp:
        log(f"{NAME}: the reference data's splits (benchmarks/overhead/plain_reference.py, not timed)")
        cli([sys.executable, str(REPO / "benchmarks/overhead/plain_reference.py"), f"{tmp}/plain"], REPO, machine)

        envs = {"machine": machine, "pinned": machine | pinned_environ(machine)}

        def side(name: str, repetition: int) -> SideRun:
            return measure("train_mlp", params, Path(tmp, "plain/data/processed"), Path(tmp, f"{name}-{repetition}"),
                           env=envs[name])

        base, cand = interleaved(repeats, partial(side, "machine"), partial(side, "pinned"), log)
    for name, done in (("machine", base), ("pinned", cand)):
        check(len({r.report["sha256"] for r in done}) == 1, f"{name}: other weights on another repetition")
    own, pinned = base[0].report, cand[0].report
    check(pinned["capability"] == "DEFAULT" and pinned["threads"] == [1],
          f"the pinned side ran {pinned['capability']} with {pinned['threads']} threads")
    train = Metric("training wall (s), mlp_model(ctx)", [r.seconds for r in base], [r.seconds for r in cand], digits=3)
    ratio = median(train.candidate) / median(train.baseline)
    return Result(
        name=NAME, description=DESCRIPTION, repeats=repeats,
        metrics=[train, Metric("process wall (s), interpreter and imports included", [r.wall for r in base],
                               [r.wall for r in cand])],
        baseline=f"the machine's kernels: torch {own['capability']}, {own['threads'][0]} threads",
        candidate="conveyor.run.determinism.pinned_environ: torch DEFAULT, MKL_CBWR=COMPATIBLE, OpenBLAS "
                  "Prescott, NumPy's baseline, 1 thread",
        setup={"params": "params.yaml train.mlp (the reference MLP), seed 42", "data": "the reference splits"},
        checks=["every process exited 0", "each side wrote the same weights on every repetition",
                "the pinned side ran torch's DEFAULT capability with 1 thread"],
        notes=[f"goal: pinned training at most {GOAL}x the machine's: {ratio:.2f}x ({met(ratio <= GOAL)})",
               f"epochs to early stop: machine {own['metrics']['epochs']}, pinned {pinned['metrics']['epochs']} "
               f"(weights {own['sha256'][:12]} vs {pinned['sha256'][:12]})"],
    )
