"""gpu-train: the reference training stages on the ``gpu`` profile (dask-cuda) vs in one process.

The question: what does a user get from putting ``train_xgb`` and ``train_mlp`` on the GPU
profile of configs/scale.yaml (``kind: dask-cuda``: a LocalCUDACluster, one worker per GPU,
started by conveyor's own ``conveyor.run.profiles``), against running the same reference task
in one process, the stage without ``on:``? Each measurement is a fresh process calling the
reference task itself with the StageContext the runner builds:

- XGBoost (``tasks.train:xgboost_model``): baseline ``ctx.client = None`` with the GPU in
  ``ctx.devices``: ``xgb.train(device="cuda")`` in this process, what a plain script on the
  GPU runs; candidate: the gpu profile's client, ``xgboost.dask`` on its worker's GPU. The
  cost of going through Dask on one GPU.
- MLP (``tasks.train:mlp_model``): baseline ``ctx.client = None``: ``tasks.mlp.fit`` in this
  process on the CPU (a stage placed in process trains on the CPU, every core's torch
  thread); candidate: the gpu profile, DDP with one NCCL rank per GPU. What the profile gives.

Data: synthetic HIGGS-shaped rows (``conveyor.ingest.synthetic``, seed 42), split and
standardised by the reference ``tasks.preprocess:prepare`` (not timed). Params: params.yaml's
``train.xgb`` (hist, 500 rounds, early stopping after 25) and ``scale.train.mlp`` with
``EPOCHS`` epochs and no early stop. The wall is of the task's call alone (reading the splits,
training, writing model and metrics), the cluster started before the clock (its start in a
note); the whole process is timed by hyperfine, its process tree's peak RSS sampled by psutil.

Before any ratio: both XGBoost sides report ``cuda`` and stop at a valid log-loss within 2 %
of each other; the MLP trained ``EPOCHS`` epochs on both sides, the candidate by NCCL.
Whether every repetition of a side trained the same model (XGBoost: best iteration and
log-loss; MLP: the weights' SHA-256) is reported, not required. Needs an NVIDIA GPU and dask-cuda
(``pip install 'conveyor[gpu]'``); without them it fails its check, naming what is missing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, rows_label, side_command

NAME = "gpu-train"
DESCRIPTION = "the reference train stages on the gpu profile (dask-cuda, one worker per GPU) vs in one process"
ROWS, QUICK_ROWS = 2_000_000, 200_000
ROWS_PER_PART = 125_000
EPOCHS = 5  # the MLP trains exactly this many epochs on both sides
QUALITY = 0.02  # the XGBoost sides' best valid logloss at most this far apart, relative
PLAIN, PROFILE = "one-process", "gpu-profile"


def _params() -> dict[str, Any]:
    """params.yaml's train.xgb, the MLP of scale.train.mlp at ``EPOCHS`` epochs, and the seed."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    mlp = {**params["scale"]["train"]["mlp"], "max_epochs": EPOCHS, "patience": EPOCHS}
    return {"train.xgb": params["train"]["xgb"], "train.mlp": mlp, "seed": int(params["seed"])}


def side_main(argv: list[str]) -> int:
    """``xgb|mlp one-process|gpu-profile PROCESSED OUT``: the reference task once; print one JSON line."""
    model, side, processed, out = argv[0], argv[1], Path(argv[2]).resolve(), Path(argv[3]).resolve()
    import torch

    from benchmarks.stages import current
    from conveyor import StageContext
    from conveyor.run.profiles import Profiles
    from conveyor.spec.profiles import DaskCudaProfile
    from conveyor.train.ddp import weights_sha256
    from tasks import models, train

    task = train.xgboost_model if model == "xgb" else train.mlp_model
    name = "train_xgb" if model == "xgb" else "train_mlp"
    metric = out / f"{name}.json"
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"side": side, "model": model}
    with ExitStack() as stack:
        client, devices = None, tuple(range(torch.cuda.device_count())) if model == "xgb" else ()
        if side == PROFILE:
            began = time.perf_counter()
            profiles = stack.enter_context(Profiles({"gpu": DaskCudaProfile(kind="dask-cuda")}))
            resources = profiles.get("gpu")
            client, devices = resources.client, resources.devices
            assert client is not None
            client.run(lambda: (__import__("torch"), __import__("xgboost"), __import__("tasks.mlp_ddp")))
            report["start"] = time.perf_counter() - began
        ctx = StageContext(stage=name, params=_params(), deps={"data/processed": processed},
                           outs={f"models/{name}": out / "model"}, metrics={f"metrics/{name}.json": metric},
                           root=out, log=logging.getLogger(f"benchmarks.{name}"), client=client,
                           n_workers=len(devices) or 1, devices=devices)
        with current(client):
            started = time.perf_counter()
            task(ctx)
            report["seconds"] = time.perf_counter() - started
    report["metrics"] = json.loads(metric.read_text())
    if model == "mlp":
        report["sha256"] = weights_sha256(models.load_mlp(out / "model")[0].state_dict())
    shutil.rmtree(out)
    print(json.dumps(report), flush=True)
    return 0


def _needs_gpu() -> None:
    import importlib.util

    import torch

    check(torch.cuda.is_available(), "needs an NVIDIA GPU: torch sees none")
    check(importlib.util.find_spec("dask_cuda") is not None, "needs dask-cuda: pip install 'conveyor[gpu]'")


def run(config: Config, log: Callable[[str], None]) -> Result:
    from benchmarks.compute.preprocess_workers import generate, preprocess_context
    from benchmarks.projects import run_side
    from tasks.preprocess import load_stats, prepare

    _needs_gpu()
    rows = QUICK_ROWS if config.quick else ROWS
    repeats = config.reps(full=3, quick=1)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-"))
    runs: dict[tuple[str, str], list[tuple[float, float, float, dict[str, Any]]]] = {}
    counter = [0]
    try:
        log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
        generate(root / "raw", rows, max(1, rows // ROWS_PER_PART))
        prepare(preprocess_context(root, root / "raw", root / "processed"))
        shutil.rmtree(root / "raw")
        splits = load_stats(root / "processed")["rows"]

        def measure(model: str, side: str, _repetition: int) -> tuple[float, float, float, dict[str, Any]]:
            counter[0] += 1
            args = side_command("benchmarks.compute.gpu_train", model, side, str(root / "processed"),
                                str(root / f"out-{counter[0]}"))
            done = run_side(args, f"{model} {side}")
            runs.setdefault((model, side), []).append((done.seconds, done.wall, done.peak_mib, done.report))
            return done.seconds, done.wall, done.peak_mib, done.report

        metrics: list[Metric] = []
        for model in ("xgb", "mlp"):
            base, cand = interleaved(repeats, partial(measure, model, PLAIN), partial(measure, model, PROFILE), log)
            label = f"{'XGBoost' if model == 'xgb' else 'MLP'} {rows_label(rows)} rows"
            for index, (what, digits) in enumerate((("wall of the training call (s)", 2),
                                                    ("wall of the whole process (s)", 2),
                                                    ("peak RSS of the process tree (MiB)", 0))):
                metrics.append(Metric(f"{label}: {what}", [float(b[index]) for b in base],  # type: ignore[arg-type]
                                      [float(c[index]) for c in cand], digits=digits))  # type: ignore[arg-type]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _check(runs)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="the reference task with no cluster: XGBoost xgb.train(device='cuda') in one process; the MLP "
                 "in one process on the CPU (a stage placed in process; torch's threads: every core)",
        candidate="the same task on the gpu profile: a dask-cuda LocalCUDACluster (one worker per GPU) started by "
                  "conveyor.run.profiles; xgboost.dask on the GPU, the MLP by DDP with one NCCL rank per GPU",
        repeats=repeats, metrics=metrics,
        setup={"data": f"{rows:,} synthetic HIGGS-shaped rows (28 float32 features), split by "
                       f"tasks.preprocess:prepare: {splits}",
               "params": json.dumps(_params()),
               "cluster": "started in the candidate's process before the clock (worker registered; torch, "
                          "xgboost and tasks.mlp_ddp imported in it)"},
        checks=[f"both XGBoost sides trained on cuda, their best valid logloss within {QUALITY:.0%}",
                f"the MLP trained {EPOCHS} epochs on both sides; the profile's by NCCL on one rank per GPU"],
        notes=_notes(runs),
    )


def _same(done: list[dict[str, Any]], model: str) -> bool:
    """Whether every repetition of one side trained the same model."""
    key = "metrics" if model == "xgb" else "sha256"
    return all(report[key] == done[0][key] for report in done[1:])


def _check(runs: dict[tuple[str, str], list[tuple[float, float, float, dict[str, Any]]]]) -> None:
    reports = {key: [r[3] for r in value] for key, value in runs.items()}
    for (model, side), done in reports.items():
        first = done[0]["metrics"]
        if model == "xgb":
            check(first["device"] == "cuda", f"xgb {side}: trained on {first['device']}, expected cuda")
        else:
            check(first["epochs"] == EPOCHS, f"mlp {side}: trained {first['epochs']} epochs, expected {EPOCHS}")
    plain, profile = reports[("xgb", PLAIN)][0]["metrics"], reports[("xgb", PROFILE)][0]["metrics"]
    apart = abs(profile["best_valid_logloss"] - plain["best_valid_logloss"])
    check(apart <= QUALITY * plain["best_valid_logloss"], f"xgboost.dask's best valid logloss "
          f"{profile['best_valid_logloss']} is more than {QUALITY:.0%} from xgb.train's {plain['best_valid_logloss']}")
    ranks = reports[("mlp", PROFILE)][0]["metrics"]
    check(ranks.get("backend") == "nccl", f"mlp on the gpu profile ran {ranks.get('backend')}, expected nccl")


def _notes(runs: dict[tuple[str, str], list[tuple[float, float, float, dict[str, Any]]]]) -> list[str]:
    import torch

    def loss(model: str, side: str, key: str) -> Any:
        return runs[(model, side)][0][3]["metrics"][key]

    start = statistics.median(float(r[3]["start"]) for key in runs if key[1] == PROFILE for r in runs[key])
    return [f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}; CPU cores: {os.cpu_count()}",
            f"starting the gpu profile (LocalCUDACluster, imports in its worker) took {start:.2f} s (median), "
            "on top of the candidate's training wall: what a run pays once when a stage starts the profile",
            f"XGBoost best valid logloss: one process {loss('xgb', PLAIN, 'best_valid_logloss')} at iteration "
            f"{loss('xgb', PLAIN, 'best_iteration')}, gpu profile {loss('xgb', PROFILE, 'best_valid_logloss')} at "
            f"{loss('xgb', PROFILE, 'best_iteration')}",
            f"MLP best valid loss: CPU in one process {loss('mlp', PLAIN, 'best_valid_loss')}, gpu profile "
            f"{loss('mlp', PROFILE, 'best_valid_loss')} (other RNG streams: other batches, the same model class)",
            "every repetition trained the same model: " + ", ".join(
                f"{model} {side} {'yes' if _same([r[3] for r in done], model) else 'NO'}"
                for (model, side), done in runs.items())]
