"""gpu-train: the reference training stages on the ``gpu`` profile (dask-cuda) vs in one process.

Each run is a fresh process (``training.side_main``) calling the reference task, on splits by
``tasks.preprocess:prepare`` (not timed), params.yaml's ``train.xgb`` and ``scale.train.mlp`` at ``EPOCHS``
epochs: no client (XGBoost with the GPU in ``ctx.devices``, the MLP on the CPU) vs the gpu profile of
configs/scale.yaml started before the clock (xgboost.dask on its worker's GPU; DDP, one NCCL rank per GPU).
Checked: both XGBoost sides ran on ``cuda`` within 2 % of each other's best valid log-loss; the MLP trained
``EPOCHS`` epochs, the candidate by NCCL. Needs an NVIDIA GPU and dask-cuda (``pip install 'conveyor[gpu]'``);
without them it fails its check, naming what is missing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.compute.training import make_splits, measure, mlp_params, side_metrics
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, rows_label
from benchmarks.projects import SideRun

NAME = "gpu-train"
DESCRIPTION = "the reference train stages on the gpu profile (dask-cuda, one worker per GPU) vs in one process"
ROWS, QUICK_ROWS = 2_000_000, 200_000
EPOCHS = 5  # the MLP trains exactly this many epochs on both sides
QUALITY = 0.02  # the XGBoost sides' best valid logloss at most this far apart, relative
PLAIN, PROFILE = "one-process", "gpu-profile"


def run(config: Config, log: Callable[[str], None]) -> Result:
    import importlib.util

    import torch
    import yaml

    check(torch.cuda.is_available(), "needs an NVIDIA GPU: torch sees none")
    check(importlib.util.find_spec("dask_cuda") is not None, "needs dask-cuda: pip install 'conveyor[gpu]'")
    rows, repeats = QUICK_ROWS if config.quick else ROWS, config.reps(full=3, quick=1)
    mlp, seed = mlp_params(EPOCHS)
    params = {"train.xgb": yaml.safe_load((REPO / "params.yaml").read_text())["train"]["xgb"], "train.mlp": mlp,
              "seed": seed}
    root, counter, metrics = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-")), itertools.count(), list[Metric]()
    runs: dict[tuple[str, str], list[SideRun]] = {}

    def one(stage: str, side: str, _repetition: int) -> SideRun:
        out = root / f"out-{next(counter)}"
        done = measure(stage, params, root / "processed", out, "none" if side == PLAIN else "gpu")
        shutil.rmtree(out)
        return done

    try:
        log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
        splits = make_splits(root, rows, root / "processed", plain=False, per_part=125_000)
        for model, label in (("xgb", "XGBoost"), ("mlp", "MLP")):
            base, cand = interleaved(repeats, partial(one, f"train_{model}", PLAIN),
                                     partial(one, f"train_{model}", PROFILE), log)
            runs[(model, PLAIN)], runs[(model, PROFILE)] = base, cand
            metrics += side_metrics(f"{label} {rows_label(rows)} rows: ", base, cand)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def got(model: str, side: str, key: str) -> Any:
        return runs[(model, side)][0].report["metrics"][key]

    for side in (PLAIN, PROFILE):
        check(got("xgb", side, "device") == "cuda", f"xgb {side}: trained on {got('xgb', side, 'device')}")
    plain, profile = (got("xgb", side, "best_valid_logloss") for side in (PLAIN, PROFILE))
    check(abs(profile - plain) <= QUALITY * plain, f"xgboost.dask's best valid logloss {profile} is more than "
                                                   f"{QUALITY:.0%} from xgb.train's {plain}")
    check(got("mlp", PROFILE, "backend") == "nccl", f"mlp on the gpu profile: {got('mlp', PROFILE, 'backend')}")
    same = {key: len({json.dumps(r.report.get("sha256", r.report["metrics"])) for r in done}) == 1
            for key, done in runs.items()}
    start = median([r.report["start"] + r.report["warm"] for (_, side), done in runs.items() if side == PROFILE
                    for r in done])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="the reference task with no cluster: XGBoost xgb.train(device='cuda') in one process; the MLP "
                 "in one process on the CPU (a stage placed in process; torch's threads: every core)",
        candidate="the same task on the gpu profile: a dask-cuda LocalCUDACluster (one worker per GPU) started by "
                  "conveyor.run.profiles; xgboost.dask on the GPU, the MLP by DDP with one NCCL rank per GPU",
        repeats=repeats, metrics=metrics,
        setup={"data": f"{rows:,} synthetic HIGGS-shaped rows, split by tasks.preprocess:prepare: {splits}",
               "params": json.dumps(params)},
        checks=[f"both XGBoost sides trained on cuda, their best valid logloss within {QUALITY:.0%}; the MLP "
                f"{EPOCHS} epochs on both sides, the profile's by NCCL on one rank per GPU"],
        notes=[f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}; CPU cores: {os.cpu_count()}; "
               f"starting the gpu profile (LocalCUDACluster, imports in its worker) took {start:.2f} s (median), "
               "outside the candidate's training wall",
               f"XGBoost best valid logloss: one process {plain} at iteration {got('xgb', PLAIN, 'best_iteration')}"
               f", gpu profile {profile} at {got('xgb', PROFILE, 'best_iteration')}; MLP best valid loss: CPU "
               f"{got('mlp', PLAIN, 'best_valid_loss')}, gpu profile {got('mlp', PROFILE, 'best_valid_loss')}",
               "every repetition trained the same model: " + ", ".join(
                   f"{model} {side} {'yes' if ok else 'NO'}" for (model, side), ok in same.items())],
    )
