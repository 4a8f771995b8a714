"""torch-ddp: the reference MLP trained in one process (2 torch threads) vs torch DDP on 2 one-thread Dask workers.

``tasks.train:mlp_model`` in a fresh process (``side_main``, shared), ``scale.train.mlp``, ``EPOCHS`` epochs, also
hidden ``WIDE``: no client vs a 2-worker LocalCluster's started before the clock (the call includes the rendezvous, the
workers' ``torch._dynamo`` import). Checked: both trained, the same weights each time, 2 gloo ranks.
"""

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from functools import cache, partial
from pathlib import Path
from statistics import median
from typing import Any

import yaml

from benchmarks import harness
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, rows_label, scratch, side_command
from benchmarks.projects import SideRun, run_side

NAME = "torch-ddp"
DESCRIPTION = "the reference MLP with torch DDP on 2 Dask workers vs in one process (2 threads), same rows and params"
WIDE = [512, 512]  # hidden layers of the wide model: ~280k weights, ~70x the reference MLP's work per row
SIZES: tuple[tuple[int, list[int] | None], ...] = ((100_000, None), (1_000_000, None), (100_000, WIDE))
EPOCHS, WORKERS = 5, 2  # every run trains exactly EPOCHS epochs


@cache
def reference() -> Any:  # params.yaml of the reference project, read once
    return yaml.safe_load((REPO / "params.yaml").read_text())


def mlp_params(epochs: int, hidden: list[int] | None = None) -> tuple[dict[str, Any], int]:
    """params.yaml's ``scale.train.mlp`` at exactly ``epochs`` epochs (and ``hidden`` where given); the seed."""
    mlp = {**reference()["scale"]["train"]["mlp"], "max_epochs": epochs, "patience": epochs}
    return mlp | ({"hidden": hidden} if hidden is not None else {}), int(reference()["seed"])


def make_splits(root: Path, rows: int, out: Path, *, plain: bool, per_part: int = 62_500) -> dict[str, int]:
    """``rows`` synthetic rows split into ``out`` by plain_preprocess.py (``plain``) or ``tasks.preprocess:prepare``."""
    from benchmarks.compute.plain_preprocess import preprocess
    from benchmarks.compute.preprocess_workers import PARAMS, generate, preprocess_context
    from tasks.preprocess import load_stats, prepare

    generate(root / "raw", rows, max(1, rows // per_part))
    if plain:
        stats = preprocess(root / "raw", out, label=PARAMS["preprocess"]["label"], seed=int(PARAMS["seed"]))
    else:
        prepare(preprocess_context(root, root / "raw", out))
        stats = load_stats(out)
    shutil.rmtree(root / "raw")
    return {split: int(n) for split, n in stats["rows"].items()}


def _warm(xgboost: bool = False) -> None:  # imported before the clock, in a side and its workers (a GPU's: xgboost)
    for module in ("torch", "conveyor.train.ddp", "tasks.mlp_ddp", "tasks.train", *(["xgboost"] * xgboost)):
        __import__(module)


def side_main(argv: list[str]) -> int:
    """``train_mlp|train_xgb PARAMS-JSON PROCESSED OUT none|cpu|gpu THREADS``: the reference task once (no cluster, 2
    CPU workers or the gpu profile, started before the clock; torch at THREADS, 0: its own); print a JSON report."""
    stage, where, threads, (processed, out) = argv[0], argv[4], int(argv[5]), (Path(a).resolve() for a in argv[2:4])
    _warm()
    import psutil
    import torch

    from benchmarks.compute.preprocess_workers import cpu_worker_env, start_cluster
    from benchmarks.stages import context, current
    from conveyor.train.ddp import weights_sha256
    from tasks import models
    from tasks.train import mlp_model, xgboost_model

    if threads:
        torch.set_num_threads(threads)
    report = dict[str, Any](threads=[torch.get_num_threads()], capability=torch.backends.cpu.get_cpu_capability())
    if where == "gpu":
        from conveyor.run.profiles import Profiles
        from conveyor.spec.profiles import DaskCudaProfile
    with ExitStack() as stack:
        client, devices, workers = None, tuple(range(torch.cuda.device_count())) if stage == "train_xgb" else (), []
        began = time.perf_counter()
        if where == "cpu":
            client = start_cluster(2, stack, cpu_worker_env())
        elif where == "gpu":
            resources = stack.enter_context(Profiles({"gpu": DaskCudaProfile(kind="dask-cuda")})).get("gpu")
            client, devices = resources.client, resources.devices
        check(where == "none" or client is not None, f"{where}: no cluster client")
        if client is not None:  # start: the cluster up and the imports in its workers
            client.run(_warm, where == "gpu")
            report["start"], workers = time.perf_counter() - began, list(client.run(os.getpid).values())
        ctx = replace(context(stage, out, params=json.loads(argv[1]), deps={"data/processed": processed},
                              outs={f"models/{stage}": out / "model"}, metrics={f"metrics/{stage}.json": out / "m"},
                              client=client, n_workers=len(devices) or len(workers) or 1), devices=devices)
        procs = [psutil.Process(pid) for pid in (os.getpid(), *workers)]
        cpu = [sum(proc.cpu_times()[:2]) for proc in procs]  # user and system seconds
        with current(client):
            report["seconds"], _ = harness.timed(lambda: (mlp_model if stage == "train_mlp" else xgboost_model)(ctx))
        report["cpu"] = [sum(proc.cpu_times()[:2]) - before for proc, before in zip(procs, cpu, strict=True)]
    report["metrics"] = json.loads((out / "m").read_text())
    if stage == "train_mlp":
        report["sha256"] = weights_sha256(models.load_mlp(out / "model")[0].state_dict())
    print(json.dumps(report), flush=True)
    return 0


def measure(stage: str, params: Mapping[str, Any], processed: Path, _repetition: int = 0, *, where: str = "none",
            threads: int = 0, env: Mapping[str, str] | None = None) -> SideRun:
    """One fresh process of ``side_main`` (:func:`projects.run_side`), the MLP checked to have trained on its ranks."""
    with scratch("train") as out:
        done = run_side(side_command(__name__, stage, json.dumps(params), str(processed), str(out), where,
                                     str(threads)), where, env)
    got, mlp = done.report["metrics"], params.get("train.mlp", {})
    if stage == "train_mlp":
        best, initial, epochs = float(got["best_valid_loss"]), float(got["initial_valid_loss"]), mlp["max_epochs"]
        check(math.isfinite(best) and best < initial, f"{where}: best valid loss {best}, initial {initial}: untrained")
        check(mlp["patience"] < epochs or got["epochs"] == epochs, f"{where}: {got['epochs']} epochs, not {epochs}")
        ranks = {"none": (None, None), "cpu": (WORKERS, "gloo"), "gpu": (got.get("world_size"), "nccl")}[where]
        check((got.get("world_size"), got.get("backend")) == ranks, f"{where}: trained on {got.get('world_size')} "
              f"ranks with {got.get('backend')}, expected {ranks}")
    return done


def side_metrics(prefix: str, base: Sequence[SideRun], cand: Sequence[SideRun]) -> list[Metric]:
    """The training call's wall (timed in the side), the whole process's (hyperfine), its tree's peak RSS (psutil)."""
    return [Metric(prefix + label, [getattr(r, key) for r in base], [getattr(r, key) for r in cand], digits=digits)
            for label, key, digits in (("wall of the training call (s)", "seconds", 2), ("wall of the whole process "
                                       "(s)", "wall", 2), ("peak RSS of the process tree (MiB)", "peak_mib", 0))]


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats, (mlp, seed) = config.reps(full=3, quick=2), mlp_params(EPOCHS)
    splits, metrics, notes = dict[int, dict[str, int]](), list[Metric](), list[str]()
    with scratch(NAME) as root:
        for rows, hidden in SIZES[:1] if config.quick else SIZES:
            label, processed = f"{rows_label(rows)} rows" + (f", hidden {hidden}" if hidden else ""), root / f"{rows}"
            if rows not in splits:
                log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
                splits[rows] = make_splits(root, rows, processed, plain=True)
            log(f"{NAME}: {label}: {repeats} interleaved repetitions")
            train = partial(measure, "train_mlp", {"train.mlp": mlp_params(EPOCHS, hidden)[0], "seed": seed}, processed)
            base, cand = interleaved(repeats, partial(train, threads=2), partial(train, where="cpu"), log)
            digests = [sorted({r.report["sha256"][:12] for r in done}) for done in (base, cand)]
            check(all(len(d) == 1 for d in digests), f"{label}: repetitions trained other weights {digests}")
            metrics += side_metrics(f"{label}: ", base, cand)
            steps = math.ceil(splits[rows]["train"] / mlp["batch_size"]) * EPOCHS
            ms = [median([r.seconds for r in done]) / steps * 1e3 for done in (base, cand)]
            cores = [median([r.report["cpu"][i] / r.seconds for r in done])
                     for done, i in ((base, 0), (cand, 1), (cand, 2))]
            notes.append(f"{label}: {ms[0]:.2f} vs {ms[1]:.2f} ms a step ({steps:,} steps of {mlp['batch_size']}, fixed"
                         f" costs included); cores busy over the call: one process {cores[0]:.2f}, DDP workers "
                         f"{cores[1]:.2f} and {cores[2]:.2f}; best valid loss " + " vs ".join(
                             f"{float(done[0].report['metrics']['best_valid_loss']):.6f}" for done in (base, cand)))
    import torch  # noqa: F401 - imported before the clock, as in the workers
    dynamo = math.nan if "torch._dynamo" in sys.modules else harness.timed(lambda: __import__("torch._dynamo"))[0]
    notes.append(f"a first import of torch._dynamo (DDP's constructor, in each fresh worker's call): {dynamo:.2f} s")
    return Result(
        name=NAME, description=DESCRIPTION, repeats=repeats, metrics=metrics, notes=notes,
        baseline="tasks.train:mlp_model with ctx.client None: tasks.mlp.fit in one process, torch.set_num_threads(2)",
        candidate=f"mlp_model on a LocalCluster({WORKERS} one-thread workers): tasks.mlp_ddp, a gloo rank per worker",
        setup={"data": "; ".join(f"{n:,} rows: {split}" for n, split in splits.items())})
