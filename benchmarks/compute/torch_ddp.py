"""torch-ddp: the reference MLP trained in one process (2 torch threads) vs torch DDP on 2 one-thread Dask workers.

The question (issue 14, item 3): what does training the reference project's MLP with torch
DDP on the stage's Dask cluster give, or cost, against the one process a user would run, on
the same rows and params? Both sides call the reference task itself, ``tasks.train:mlp_model``,
with a hand-built StageContext (as the runner builds it), each measurement in a fresh process:

- baseline: ``mlp_model(ctx)`` with ``ctx.client = None``: ``tasks.mlp.fit`` in this process
  (what a stage without ``on:`` runs), with ``torch.set_num_threads(2)`` (the machine's 2 cores);
- candidate: ``mlp_model(ctx)`` with the client of a ``LocalCluster(n_workers=2,
  threads_per_worker=1, processes=True)`` started in the same process before the clock starts
  (its start is in a note): ``tasks.mlp_ddp.train`` through ``conveyor.train.ddp.run_ddp``, one
  rank per worker, gloo on CPU; ``run_rank`` runs each rank with one torch thread. The global
  batch is split over the ranks (512 rows each), and DDP averages their gradients.

Data: synthetic HIGGS-shaped rows (``conveyor.ingest.synthetic``, seed 42), split and
standardised once per size by ``benchmarks/compute/plain_preprocess.py`` (not timed). Params:
params.yaml's ``scale.train.mlp`` (hidden [64, 32], Adam, global batch 1024) with ``max_epochs``
and ``patience`` both ``EPOCHS``: the same work on both sides, no early stop. The same again
with hidden layers ``WIDE`` (~70x the work per row): does DDP pay as a step's compute grows?
Both sides import torch and the task's modules before the clock starts (the candidate also
in its workers); the wall is of ``mlp_model(ctx)`` alone: reading the splits, training,
writing the model and metrics; for DDP also the rendezvous, each rank reading the splits,
each worker's first import of ``torch._dynamo`` (DDP's constructor imports it) and the check
that the ranks agree. The whole process's wall (hyperfine) and the peak RSS of its process
tree (psutil, every 100 ms: the nannies and workers too) are the other two metrics.

Before any ratio: every process exits 0 and leaves nothing running; each side trained
exactly ``EPOCHS`` epochs to a finite best valid loss below its initial one, with the same
weights on every repetition (seeded, deterministic kernels); the DDP side ran 2 gloo ranks,
whose weights agree (``tasks.mlp_ddp.train`` checks every rank's SHA-256 and rank 0's file,
and the process exits 1 otherwise). Whether the two sides train the same weights is
reported, not required: the two shuffle with other RNGs, so they see other batches. No goal.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.compute.preprocess_workers import cpu_worker_env
from benchmarks.harness import (
    REPO,
    Config,
    Metric,
    Result,
    check,
    interleaved,
    rows_label,
    side_command,
    timed,
)
from benchmarks.projects import SideRun

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from distributed import Client

NAME = "torch-ddp"
DESCRIPTION = "the reference MLP with torch DDP on 2 Dask workers vs in one process (2 threads), same rows and params"
WIDE = [512, 512]  # hidden layers of the wide model: ~280k weights, ~70x the reference MLP's work per row
# (rows, hidden layers; None: the reference MLP's): where DDP's all-reduce is a smaller share of a step
SIZES: tuple[tuple[int, list[int] | None], ...] = ((100_000, None), (1_000_000, None), (100_000, WIDE))
QUICK_SIZES: tuple[tuple[int, list[int] | None], ...] = ((100_000, None),)
ROWS_PER_PART = 62_500
LABEL = "target"
EPOCHS = 5  # max_epochs and patience: every run trains exactly this many epochs
WORKERS = 2
PLAIN, DDP = "one-process", "ddp"


def reference_params(hidden: list[int] | None = None) -> tuple[dict[str, Any], int]:
    """params.yaml's ``scale.train.mlp`` with ``max_epochs`` and ``patience`` set to ``EPOCHS`` (and
    ``hidden`` where given), and the seed."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    mlp = {**params["scale"]["train"]["mlp"], "max_epochs": EPOCHS, "patience": EPOCHS}
    return mlp | ({"hidden": hidden} if hidden is not None else {}), int(params["seed"])


# --- one side, in its own process ---------------------------------------------------------


def _warm() -> None:
    """What both sides import before the clock starts (the candidate also in each worker)."""
    for module in ("torch", "conveyor.train.ddp", "tasks.mlp_ddp", "tasks.train"):
        importlib.import_module(module)


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (psutil)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def side_main(argv: list[str]) -> int:
    """``one-process|ddp PROCESSED OUT [HIDDEN]``: ``tasks.train:mlp_model`` once, writing into OUT; print one
    JSON line. HIDDEN: the hidden layers as JSON (default: the reference MLP's).

    ``seconds``: the task alone; ``cpu``: CPU seconds over the task, of this process and (ddp)
    of each worker; ``threads``: torch's threads (ddp: each worker's default, before
    ``run_rank`` sets 1); ``metrics``: what the task wrote; ``sha256``: of the saved weights;
    for ddp ``start`` (cluster up, both workers registered) and ``warm`` (imports in the workers).
    """
    side, processed, out = argv[0], Path(argv[1]).resolve(), Path(argv[2]).resolve()
    if side not in (PLAIN, DDP):
        raise SystemExit(f"torch_ddp: unknown side {side!r}, expected {PLAIN} or {DDP}")
    _warm()
    import torch
    from distributed import Client, LocalCluster

    from benchmarks.stages import current
    from conveyor import StageContext
    from conveyor.run.nanny_env import undo_nanny_environ, worker_environ
    from conveyor.train.ddp import weights_sha256
    from tasks import models
    from tasks.train import mlp_model

    params, seed = reference_params(json.loads(argv[3]) if len(argv) > 3 else None)
    report: dict[str, Any] = {"side": side}

    def train(client: Client | None) -> None:
        ctx = StageContext(stage="train_mlp", params={"train.mlp": params, "seed": seed},
                           deps={"data/processed": processed}, outs={"models/mlp.pt": out / "mlp.pt"},
                           metrics={"metrics/train_mlp.json": out / "train_mlp.json"}, root=out,
                           log=logging.getLogger("benchmarks.train_mlp"), client=client,
                           n_workers=WORKERS if client is not None else 1)
        pids = list(client.run(os.getpid).values()) if client is not None else []
        cpu = [_cpu_seconds(os.getpid()), *(_cpu_seconds(pid) for pid in pids)]
        with current(client):
            report["seconds"], _ = timed(lambda: mlp_model(ctx))
        used = [_cpu_seconds(pid) - before for pid, before in zip([os.getpid(), *pids], cpu, strict=True)]
        report["cpu"] = {"process": used[0], "workers": used[1:]}

    out.mkdir(parents=True, exist_ok=True)
    if side == PLAIN:
        torch.set_num_threads(2)
        report["threads"] = [torch.get_num_threads()]
        train(None)
    else:
        began = time.perf_counter()
        with worker_environ(cpu_worker_env()), undo_nanny_environ():  # as the scale.yaml cpu profile starts it
            cluster = LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0")
        with cluster, Client(cluster) as client:
            client.wait_for_workers(WORKERS, timeout=120)
            report["start"] = time.perf_counter() - began
            report["warm"], _ = timed(lambda: client.run(_warm))
            report["threads"] = list(client.run(_torch_threads).values())
            train(client)
    report["metrics"] = json.loads((out / "train_mlp.json").read_text())
    report["sha256"] = weights_sha256(models.load_mlp(out / "mlp.pt")[0].state_dict())
    print(json.dumps(report), flush=True)
    return 0


# --- the benchmark --------------------------------------------------------------------------


@dataclass
class Run(SideRun):
    """One measurement of one side, and the weights it saved."""

    weights: dict[str, npt.NDArray[np.float32]]


@dataclass
class Size:
    """Everything measured at one number of rows and one model."""

    rows: int
    hidden: list[int] | None  # None: the reference MLP's
    splits: dict[str, int]
    runs: dict[str, list[Run]] = field(default_factory=lambda: {PLAIN: [], DDP: []})

    def median(self, side: str, what: str) -> float:
        return statistics.median(float(getattr(r, what)) for r in self.runs[side])

    @property
    def label(self) -> str:
        return f"{rows_label(self.rows)} rows" + ("" if self.hidden is None else f", hidden {self.hidden}")

    @property
    def what(self) -> str:
        return f"{self.rows:,} rows" + ("" if self.hidden is None else f" with hidden layers {self.hidden}")

    def loss(self, side: str) -> float:
        return float(self.runs[side][0].report["metrics"]["best_valid_loss"])


def measure(side: str, processed: Path, out: Path, hidden: list[int] | None) -> Run:
    """One fresh process of ``side`` training on ``processed``; what it wrote in ``out`` is read and removed."""
    import numpy as np

    from benchmarks.projects import run_side
    from tasks import models

    args = side_command("benchmarks.compute.torch_ddp", side, str(processed), str(out),
                        *([] if hidden is None else [json.dumps(hidden)]))
    done = run_side(args, side)
    report = done.report
    metrics = report["metrics"]
    check(metrics["epochs"] == EPOCHS, f"{side}: trained {metrics['epochs']} epochs, expected {EPOCHS}")
    best, initial = float(metrics["best_valid_loss"]), float(metrics["initial_valid_loss"])
    check(math.isfinite(best) and best < initial, f"{side}: best valid loss {best} is not a finite loss below "
                                                  f"the initial {initial}: it did not train")
    if side == DDP:
        check(metrics.get("world_size") == WORKERS and metrics.get("backend") == "gloo",
              f"ddp: trained on {metrics.get('world_size')} ranks with {metrics.get('backend')}, expected "
              f"{WORKERS} with gloo")
    state = models.load_mlp(out / "mlp.pt")[0].state_dict()
    weights = {name: np.asarray(tensor.detach().numpy(), dtype=np.float32) for name, tensor in state.items()}
    shutil.rmtree(out)
    return Run(done.seconds, done.wall, done.peak_mib, report, weights)


def run(config: Config, log: Callable[[str], None]) -> Result:
    from benchmarks.compute.plain_preprocess import preprocess
    from benchmarks.compute.preprocess_workers import generate

    sizes = QUICK_SIZES if config.quick else SIZES
    repeats = config.reps(full=3, quick=2)
    _, seed = reference_params()
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-torch-ddp-"))
    measured: list[Size] = []
    counter = [0]
    splits: dict[int, dict[str, int]] = {}  # rows -> rows per split, of data generated already
    try:
        for rows, hidden in sizes:
            data = root / f"data-{rows}"
            if rows not in splits:
                log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
                generate(data / "raw", rows, max(1, rows // ROWS_PER_PART))
                stats = preprocess(data / "raw", data / "processed", label=LABEL, seed=seed)
                shutil.rmtree(data / "raw")
                splits[rows] = {split: int(n) for split, n in stats["rows"].items()}
            size = Size(rows, hidden, splits[rows])

            def one(side: str, size: Size = size, processed: Path = data / "processed") -> Run:
                counter[0] += 1
                done = measure(side, processed, root / f"run-{counter[0]:03d}-{side}", size.hidden)
                size.runs[side].append(done)
                log(f"  {size.label} {side}: {done.seconds:.2f} s training, {done.wall:.2f} s process, "
                    f"{done.peak_mib:.0f} MiB")
                return done

            log(f"{NAME}: {size.what} ({size.splits['train']:,} to train on): {repeats} interleaved repetitions")
            interleaved(repeats, lambda _i: one(PLAIN), lambda _i: one(DDP), log)
            measured.append(size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for size in measured:  # each side is deterministic: the same weights on every repetition
        for side in (PLAIN, DDP):
            digests = {r.report["sha256"] for r in size.runs[side]}
            check(len(digests) == 1, f"{side}: {size.what}: repetitions trained different weights "
                                     f"({', '.join(d[:12] for d in sorted(digests))})")
    dynamo = _dynamo_import_seconds()
    return _result(config, repeats, measured, dynamo)


def _dynamo_import_seconds() -> float | None:
    """Seconds of a first ``import torch._dynamo`` here (what each fresh DDP worker pays); None if already imported."""
    if "torch._dynamo" in sys.modules:
        return None
    import torch  # noqa: F401 - imported before the clock, as in the workers

    seconds, _ = timed(lambda: importlib.import_module("torch._dynamo"))
    return seconds


def _result(config: Config, repeats: int, sizes: list[Size], dynamo: float | None) -> Result:
    params, seed = reference_params()
    metrics: list[Metric] = []
    ratios: dict[str, float] = {}
    for size in sizes:
        wall = Metric(f"{size.label}: wall of the training call (s)", [r.seconds for r in size.runs[PLAIN]],
                      [r.seconds for r in size.runs[DDP]])
        ratios[size.label] = statistics.median(wall.ratios())
        metrics += [wall,
                    Metric(f"{size.label}: wall of the whole process (s)", [r.wall for r in size.runs[PLAIN]],
                           [r.wall for r in size.runs[DDP]]),
                    Metric(f"{size.label}: peak RSS of the process tree (MiB)",
                           [r.peak_mib for r in size.runs[PLAIN]], [r.peak_mib for r in size.runs[DDP]], digits=0)]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="tasks.train:mlp_model with ctx.client None: tasks.mlp.fit in one process, torch.set_num_threads(2)",
        candidate=f"mlp_model with a LocalCluster(n_workers={WORKERS}, threads_per_worker=1) client: tasks.mlp_ddp "
                  "through conveyor.train.ddp.run_ddp, one gloo rank per worker, 1 torch thread each",
        repeats=repeats, metrics=metrics,
        setup={"data": "; ".join(f"{n:,} rows: {split}" for n, split in {s.rows: s.splits for s in sizes}.items()),
               "params": f"{json.dumps(params)}; seed {seed}; the wide model: hidden {WIDE}",
               "workers' worker_env": json.dumps(cpu_worker_env()), "cores": str(os.cpu_count())},
        checks=["every process exited 0 and left no process of its group running",
                f"each side trained exactly {EPOCHS} epochs to a finite best valid loss below its initial one",
                "each side saved the same weights (SHA-256) on every repetition",
                f"the DDP side ran {WORKERS} ranks with gloo, and its ranks ended with the same weights, which rank 0 "
                "saved (tasks.mlp_ddp.train checks it; the process exits 1 otherwise)"],
        notes=_notes(config, sizes, ratios, dynamo),
    )


def _notes(config: Config, sizes: list[Size], ratios: dict[str, float], dynamo: float | None) -> list[str]:
    batch = int(reference_params()[0]["batch_size"])
    notes = ["goal (issue 14, item 3): the comparison reported; no threshold"]
    for size in sizes:
        ratio = ratios[size.label]
        verdict = f"DDP {ratio:.2f}x faster" if ratio >= 1 else f"DDP {1 / ratio:.2f}x slower"
        steps = math.ceil(size.splits["train"] / batch) * EPOCHS
        plain_s, ddp_s = size.median(PLAIN, "seconds"), size.median(DDP, "seconds")
        notes.append(
            f"{size.what} ({size.splits['train']:,} to train on): the training call took {plain_s:.2f} s in "
            f"one process, {ddp_s:.2f} s with DDP: {verdict} (median of per-repetition ratios {ratio:.2f}x); "
            f"{steps:,} optimiser steps of {batch} rows, so about {plain_s / steps * 1e3:.2f} vs "
            f"{ddp_s / steps * 1e3:.2f} ms a step, fixed costs included")
    wins = [f"{size.what} ({ratios[size.label]:.2f}x)" for size in sizes if ratios[size.label] > 1]
    best = max(sizes, key=lambda s: ratios[s.label])
    ran = "; ".join(s.what for s in sizes) + ("; --quick" if config.quick else "")
    notes.append(f"DDP on 2 workers pays at {', '.join(wins)} (measured: {ran})" if wins else
                 f"DDP on 2 workers does not pay at any size measured ({ran}; closest: {ratios[best.label]:.2f}x at "
                 f"{best.what}): on one machine's {os.cpu_count()} cores ranks only add their all-reduce")
    for size in sizes:
        first, other = size.runs[PLAIN][0], size.runs[DDP][0]  # the same weights? their largest difference
        same = first.report["sha256"] == other.report["sha256"]
        apart = max(float(abs(first.weights[k] - other.weights[k]).max()) for k in first.weights)
        plain, ddp = size.loss(PLAIN), size.loss(DDP)
        notes.append(
            f"{size.what}: the same weights on both sides: {'yes' if same else 'no'} (largest difference "
            f"{apart:.3g}); best valid loss {plain:.6f} in one process (epoch "
            f"{size.runs[PLAIN][0].report['metrics']['best_epoch']}), {ddp:.6f} with DDP (epoch "
            f"{size.runs[DDP][0].report['metrics']['best_epoch']}): {abs(ddp - plain):.2g} apart "
            f"({abs(ddp - plain) / plain:.2%})"
            + ("" if same else "; expected: the two shuffle with other RNGs"))
    notes.append(_threads_note(sizes))
    ddp_runs = [r for size in sizes for r in size.runs[DDP]]
    start = statistics.median(float(r.report["start"]) for r in ddp_runs)
    warm = statistics.median(float(r.report["warm"]) for r in ddp_runs)
    notes.append(f"starting the 2-worker LocalCluster took {start:.2f} s, importing torch and the task's modules in "
                 f"the workers {warm:.2f} s (medians over {len(ddp_runs)} runs; outside the training call); the call "
                 "includes each fresh worker's first import of torch._dynamo (DDP's constructor imports it): "
                 + (f"{dynamo:.2f} s in a fresh import here" if dynamo is not None else "not measured here"))
    return notes


def _threads_note(sizes: list[Size]) -> str:
    """What the CPU counters say about the threads each side used during the training call."""
    parts = []
    for size in sizes:
        plain = size.runs[PLAIN]
        ddp = size.runs[DDP]
        plain_cores = statistics.median(r.report["cpu"]["process"] / r.seconds for r in plain)
        worker_cores = [statistics.median(r.report["cpu"]["workers"][i] / r.seconds for r in ddp)
                        for i in range(WORKERS)]
        client_cores = statistics.median(r.report["cpu"]["process"] / r.seconds for r in ddp)
        parts.append(f"{size.label}: one process {plain_cores:.2f} cores, DDP workers "
                     f"{' and '.join(f'{c:.2f}' for c in worker_cores)} cores, the DDP client process (client and "
                     f"scheduler) {client_cores:.2f}")
    plain_threads = sorted({t for size in sizes for r in size.runs[PLAIN] for t in r.report["threads"]})
    worker_threads = sorted({t for size in sizes for r in size.runs[DDP] for t in r.report["threads"]})
    why = " (Dask's default nanny environment: OMP_NUM_THREADS=1)" if worker_threads == [1] else ""
    return (f"threads: torch.get_num_threads() was {plain_threads} in the one process and {worker_threads} in each "
            f"worker before training{why}, and run_rank sets 1 for the rank; CPU seconds over the training call's "
            "wall, medians: " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(side_main(sys.argv[1:]))
