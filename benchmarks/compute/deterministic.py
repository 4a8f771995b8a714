"""deterministic: the reference MLP trained with the pinned kernel paths vs with the machine's own.

The question (issue 35): what does ``deterministic: true`` cost? A deterministic stage's
process runs torch's baseline kernels instead of its AVX2/AVX-512 ones, MKL's compatible code
path, and one thread (:mod:`conveyor.run.determinism`); the goal is at most 1.3x the
training's wall without them. Both sides call the reference task, ``tasks.train:mlp_model``,
with the params of ``train.mlp`` (params.yaml) on the reference data's splits (written once
by ``benchmarks/overhead/plain_reference.py``, not timed), each in a fresh process:

- baseline: the environment as it is (torch picks its kernels and one thread per core);
- candidate: that environment with ``pinned_environ`` over it, as conveyor starts a
  deterministic stage's process.

Both import torch and the task's modules before the clock starts; the wall is of
``mlp_model(ctx)`` alone (read the splits, train to early stop, write model and metrics).
The whole process's wall is the second metric: it is what a deterministic task stage
costs against the same task in conveyor's own process at most (there the imports move
from one process to the other; the interpreter's start is the difference).

Before any ratio: every process exits 0; each side writes the same weights on every
repetition; the candidate ran torch's DEFAULT capability with one thread, the baseline its
machine's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, side_command, side_report

NAME = "deterministic"
DESCRIPTION = "the reference MLP with deterministic: true's pinned kernels and one thread vs the machine's own"
GOAL = 1.3  # the candidate's training wall at most this many times the baseline's
BASELINE, PINNED = "machine", "pinned"


def side_main(argv: list[str]) -> int:
    """``PROCESSED OUT``: ``tasks.train:mlp_model`` once, writing into OUT; print one JSON line."""
    import logging

    import torch
    import yaml

    from conveyor import StageContext
    from tasks.train import mlp_model

    processed, out = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    model, metrics = out / "mlp.pt", out / "train_mlp.json"
    ctx = StageContext(stage="train_mlp", params={"train.mlp": params["train"]["mlp"], "seed": params["seed"]},
                       deps={"data/processed": processed}, outs={"models/mlp.pt": model},
                       metrics={"metrics/train_mlp.json": metrics}, root=REPO, log=logging.getLogger("benchmark"))
    began = time.perf_counter()
    mlp_model(ctx)
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                      "threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
                      "epochs": json.loads(metrics.read_text())["epochs"]}))
    return 0


def _side(side: str, processed: Path, work: Path, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    out = work / side
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    began = time.perf_counter()
    done = subprocess.run(side_command("benchmarks.compute.deterministic", str(processed), str(out)), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - began
    check(done.returncode == 0, f"{side}: exit {done.returncode}: {done.stderr[-2000:]}")
    return wall, side_report(done.stdout, side)


def run(config: Config, log: Callable[[str], None]) -> Result:
    from conveyor.run.determinism import pinned_environ

    repeats = config.reps(7, 2)
    machine_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    pinned_env = machine_env | pinned_environ(machine_env)
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-deterministic-") as tmp:
        work = Path(tmp)
        log(f"{NAME}: the reference data's splits (benchmarks/overhead/plain_reference.py, not timed)")
        subprocess.run([sys.executable, str(REPO / "benchmarks/overhead/plain_reference.py"), str(work / "plain")],
                       cwd=REPO, env=machine_env, check=True, capture_output=True, timeout=600)
        processed = work / "plain/data/processed"
        base, cand = interleaved(repeats, lambda _i: _side(BASELINE, processed, work, machine_env),
                                 lambda _i: _side(PINNED, processed, work, pinned_env), log)
    reports = {BASELINE: [r for _, r in base], PINNED: [r for _, r in cand]}
    for side, side_reports in reports.items():
        check(len({r["sha256"] for r in side_reports}) == 1, f"{side}: other weights on another repetition")
    pinned, own = reports[PINNED][0], reports[BASELINE][0]
    check(pinned["capability"] == "DEFAULT" and pinned["threads"] == 1,
          f"the pinned side ran {pinned['capability']} with {pinned['threads']} threads")
    train = Metric("training wall (s), mlp_model(ctx)", [r["seconds"] for r in reports[BASELINE]],
                   [r["seconds"] for r in reports[PINNED]], digits=3)
    process = Metric("process wall (s), interpreter and imports included", [w for w, _ in base], [w for w, _ in cand])
    ratio = statistics.median(train.candidate) / statistics.median(train.baseline)
    return Result(
        name=NAME, description=DESCRIPTION, repeats=repeats, metrics=[train, process],
        baseline=f"the machine's kernels: torch {own['capability']}, {own['threads']} threads",
        candidate="conveyor.run.determinism.pinned_environ: torch DEFAULT, MKL_CBWR=COMPATIBLE, OpenBLAS "
                  "Prescott, NumPy's baseline, 1 thread",
        setup={"params": "params.yaml train.mlp (the reference MLP), seed 42", "data": "the reference splits"},
        checks=["every process exited 0", "each side wrote the same weights on every repetition",
                "the pinned side ran torch's DEFAULT capability with 1 thread"],
        notes=[f"goal: pinned training at most {GOAL}x the machine's: {ratio:.2f}x "
               f"({'met' if ratio <= GOAL else 'NOT met'})",
               f"epochs to early stop: machine {own['epochs']}, pinned {pinned['epochs']} (the bytes differ: "
               f"weights {own['sha256'][:12]} vs {pinned['sha256'][:12]})"],
    )
