"""What the training benchmarks share: the reference params, synthetic splits, a CPU cluster, one side's process."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import commands
from benchmarks.harness import REPO, Metric, check, side_command, side_report, timed
from benchmarks.projects import SideRun, repo_env

if TYPE_CHECKING:
    from distributed import Client


def mlp_params(epochs: int, hidden: list[int] | None = None) -> tuple[dict[str, Any], int]:
    """params.yaml's ``scale.train.mlp`` at exactly ``epochs`` epochs (and ``hidden`` where given); the seed."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    mlp = {**params["scale"]["train"]["mlp"], "max_epochs": epochs, "patience": epochs}
    return mlp | ({"hidden": hidden} if hidden is not None else {}), int(params["seed"])


def make_splits(root: Path, rows: int, out: Path, *, plain: bool, per_part: int = 62_500) -> dict[str, int]:
    """``rows`` synthetic HIGGS-shaped rows (seed 42) split and standardised into ``out`` (not timed) by
    benchmarks/compute/plain_preprocess.py (``plain``) or the reference ``tasks.preprocess:prepare``."""
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


@contextmanager
def cpu_cluster(workers: int) -> Iterator[tuple[Client, float]]:
    """A LocalCluster of ``workers`` one-thread processes in the cpu profile's (configs/scale.yaml) environment;
    and the seconds until all registered."""
    from distributed import Client, LocalCluster

    from benchmarks.compute.preprocess_workers import cpu_worker_env
    from conveyor.run.nanny_env import undo_nanny_environ, worker_environ

    began = time.perf_counter()
    with worker_environ(cpu_worker_env()), undo_nanny_environ():
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0")
    with cluster, Client(cluster) as client:
        client.wait_for_workers(workers, timeout=120)
        yield client, time.perf_counter() - began


def _warm(xgboost: bool = False) -> None:  # imported before the clock, in a side and its workers (a GPU's: xgboost)
    for module in ("torch", "conveyor.train.ddp", "tasks.mlp_ddp", "tasks.train", *(["xgboost"] * xgboost)):
        importlib.import_module(module)


def side_main(argv: list[str]) -> int:
    """``train_mlp|train_xgb PARAMS-JSON PROCESSED OUT none|cpu|gpu THREADS``: the reference task once, with no
    cluster, a 2-worker ``cpu_cluster`` or the gpu profile started before the clock, torch at THREADS (0: its own);
    print one JSON line (``seconds``, ``cpu`` per process, torch's ``threads``, ``metrics``, ``sha256``...)."""
    stage, params, where, threads = argv[0], json.loads(argv[1]), argv[4], int(argv[5])
    processed, out = Path(argv[2]).resolve(), Path(argv[3]).resolve()
    _warm()
    import psutil
    import torch

    from benchmarks.stages import current
    from conveyor import StageContext
    from conveyor.train.ddp import weights_sha256
    from tasks import models, train

    if threads:
        torch.set_num_threads(threads)
    task = train.mlp_model if stage == "train_mlp" else train.xgboost_model
    report: dict[str, Any] = {"side": where, "threads": [torch.get_num_threads()],
                              "capability": torch.backends.cpu.get_cpu_capability()}
    if where == "gpu":
        from conveyor.run.profiles import Profiles
        from conveyor.spec.profiles import DaskCudaProfile
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        client, devices = None, tuple(range(torch.cuda.device_count())) if stage == "train_xgb" else ()
        began = time.perf_counter()
        if where == "cpu":
            client = stack.enter_context(cpu_cluster(2))[0]
        elif where == "gpu":
            resources = stack.enter_context(Profiles({"gpu": DaskCudaProfile(kind="dask-cuda")})).get("gpu")
            client, devices = resources.client, resources.devices
        check(where == "none" or client is not None, f"{where}: no cluster client")
        if client is not None:
            report["start"] = time.perf_counter() - began
            report["warm"], _ = timed(lambda: client.run(_warm, where == "gpu"))
            report["threads"] = list(client.run(torch.get_num_threads).values())
        workers = list(client.run(os.getpid).values()) if client is not None else []
        ctx = StageContext(stage=stage, params=params, deps={"data/processed": processed}, root=out, client=client,
                           outs={f"models/{stage}": out / "model"}, metrics={f"metrics/{stage}.json": out / "m.json"},
                           log=logging.getLogger(f"benchmarks.{stage}"), devices=devices,
                           n_workers=len(devices) or len(workers) or 1)
        procs = [psutil.Process(pid) for pid in (os.getpid(), *workers)]
        cpu = [sum(proc.cpu_times()[:2]) for proc in procs]  # user and system seconds
        with current(client):
            report["seconds"], _ = timed(lambda: task(ctx))
        report["cpu"] = [sum(proc.cpu_times()[:2]) - before for proc, before in zip(procs, cpu, strict=True)]
    report["metrics"] = json.loads((out / "m.json").read_text())
    if stage == "train_mlp":
        report["sha256"] = weights_sha256(models.load_mlp(out / "model")[0].state_dict())
    print(json.dumps(report), flush=True)
    return 0


def measure(stage: str, params: Mapping[str, Any], processed: Path, out: Path, where: str = "none", threads: int = 0,
            env: Mapping[str, str] | None = None) -> SideRun:
    """One fresh process of ``side_main`` (hyperfine; psutil), the MLP checked to have trained."""
    done = commands.timed(side_command(__name__, stage, json.dumps(params), str(processed), str(out), where,
                                       str(threads)), REPO, env or repo_env(), memory=True)
    report = side_report(done.stdout, where)
    got, mlp = report["metrics"], params.get("train.mlp", {})
    if stage == "train_mlp":
        best, initial = float(got["best_valid_loss"]), float(got["initial_valid_loss"])
        check(math.isfinite(best) and best < initial, f"{where}: best valid loss {best}, initial {initial}: untrained")
        check(mlp["patience"] < mlp["max_epochs"] or got["epochs"] == mlp["max_epochs"],
              f"{where}: trained {got['epochs']} epochs, expected {mlp['max_epochs']}")
    return SideRun(float(report["seconds"]), done.seconds, done.peak_mib, report)


def side_metrics(prefix: str, base: Sequence[SideRun], cand: Sequence[SideRun]) -> list[Metric]:
    """The training call's wall (timed in the side), the whole process's (hyperfine), its tree's peak RSS (psutil)."""
    return [Metric(f"{prefix}{label}", [float(getattr(r, key)) for r in base], [float(getattr(r, key)) for r in cand],
                   digits=digits) for label, key, digits in (("wall of the training call (s)", "seconds", 2),
                                                             ("wall of the whole process (s)", "wall", 2),
                                                             ("peak RSS of the process tree (MiB)", "peak_mib", 0))]
