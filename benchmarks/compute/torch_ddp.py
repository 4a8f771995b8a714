"""torch-ddp: the reference MLP trained in one process (2 torch threads) vs torch DDP on 2 one-thread Dask workers.

Both sides run ``tasks.train:mlp_model`` in a fresh process (``training.side_main``) on the same splits, with
``scale.train.mlp`` at exactly ``EPOCHS`` epochs, also with hidden layers ``WIDE``: no client (``tasks.mlp.fit``)
vs a 2-worker LocalCluster's, started before the clock (``tasks.mlp_ddp``: a gloo rank per worker, the batch
split; the call includes the rendezvous and each fresh worker's import of ``torch._dynamo``). Checked: the same
weights on every repetition of a side, 2 gloo ranks (``tasks.mlp_ddp`` checks they agree). The sides' weights are
compared, not required equal (other RNGs shuffle). No goal.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.compute.preprocess_workers import cpu_worker_env
from benchmarks.compute.training import make_splits, measure, mlp_params, side_metrics
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, rows_label, timed
from benchmarks.projects import SideRun

NAME = "torch-ddp"
DESCRIPTION = "the reference MLP with torch DDP on 2 Dask workers vs in one process (2 threads), same rows and params"
WIDE = [512, 512]  # hidden layers of the wide model: ~280k weights, ~70x the reference MLP's work per row
SIZES: tuple[tuple[int, list[int] | None], ...] = ((100_000, None), (1_000_000, None), (100_000, WIDE))
QUICK_SIZES: tuple[tuple[int, list[int] | None], ...] = ((100_000, None),)
EPOCHS = 5  # max_epochs and patience: every run trains exactly this many epochs
WORKERS = 2
PLAIN, DDP = "one-process", "ddp"


def _one(side: str, repetition: int, *, params: dict[str, Any], processed: Path, root: Path,
         weights: dict[str, Any]) -> SideRun:
    """One checked run of ``side``; the first run's weights kept in ``weights[side]``."""
    from tasks import models

    out = root / f"{repetition}-{side}"
    done = measure("train_mlp", params, processed, out, "none" if side == PLAIN else "cpu", 2 if side == PLAIN else 0)
    got = done.report["metrics"]
    check(side == PLAIN or (got.get("world_size"), got.get("backend")) == (WORKERS, "gloo"),
          f"ddp: trained on {got.get('world_size')} ranks with {got.get('backend')}, expected {WORKERS} with gloo")
    weights.setdefault(side, {k: t.numpy().copy() for k, t in models.load_mlp(out / "model")[0].state_dict().items()})
    shutil.rmtree(out)
    return done


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=3, quick=2)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-torch-ddp-"))
    splits, metrics, notes, ddp_runs = dict[int, dict[str, int]](), list[Metric](), list[str](), list[SideRun]()
    threads: dict[str, set[int]] = {PLAIN: set(), DDP: set()}
    mlp, seed = mlp_params(EPOCHS)
    try:
        for k, (rows, hidden) in enumerate(QUICK_SIZES if config.quick else SIZES):
            label = f"{rows_label(rows)} rows" + ("" if hidden is None else f", hidden {hidden}")
            processed = root / f"data-{rows}" / "processed"
            if rows not in splits:
                log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
                splits[rows] = make_splits(processed.parent, rows, processed, plain=True)
            log(f"{NAME}: {label}: {repeats} interleaved repetitions")
            weights: dict[str, Any] = {}
            one = partial(_one, params={"train.mlp": mlp_params(EPOCHS, hidden)[0], "seed": seed},
                          processed=processed, root=root / f"run-{k}", weights=weights)
            base, cand = interleaved(repeats, partial(one, PLAIN), partial(one, DDP), log)
            for side, done in ((PLAIN, base), (DDP, cand)):
                digests = {r.report["sha256"][:12] for r in done}
                check(len(digests) == 1, f"{side}: {label}: repetitions trained different weights {sorted(digests)}")
                threads[side].update(t for r in done for t in r.report["threads"])
            ddp_runs += cand
            metrics += side_metrics(f"{label}: ", base, cand)
            steps = math.ceil(splits[rows]["train"] / mlp["batch_size"]) * EPOCHS
            cores = [median([r.report["cpu"][i] / r.seconds for r in runs])
                     for runs, i in ((base, 0), (cand, 1), (cand, 2), (cand, 0))]
            loss = [float(done[0].report["metrics"]["best_valid_loss"]) for done in (base, cand)]
            apart = max(float(abs(weights[PLAIN][key] - weights[DDP][key]).max()) for key in weights[PLAIN])
            notes.append(f"{label} ({splits[rows]['train']:,} to train on, {steps:,} steps of {mlp['batch_size']}): "
                         f"{median([r.seconds for r in base]) / steps * 1e3:.2f} vs "
                         f"{median([r.seconds for r in cand]) / steps * 1e3:.2f} ms a step, fixed costs included; "
                         f"cores busy over the call: one process {cores[0]:.2f}, DDP workers {cores[1]:.2f} and "
                         f"{cores[2]:.2f}, the DDP client process {cores[3]:.2f}; the same weights on both sides: "
                         f"{'yes' if base[0].report['sha256'] == cand[0].report['sha256'] else 'no'} (largest "
                         f"difference {apart:.3g}); best valid loss {loss[0]:.6f} vs {loss[1]:.6f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import torch  # noqa: F401 - imported before the clock, as in the workers

    dynamo = None if "torch._dynamo" in sys.modules else timed(lambda: importlib.import_module("torch._dynamo"))[0]
    notes.append(f"torch threads before training: {sorted(threads[PLAIN])} in the one process, "
                 f"{sorted(threads[DDP])} in each worker (run_rank sets 1); starting the LocalCluster took "
                 f"{median([r.report['start'] for r in ddp_runs]):.2f} s, importing torch and the task's modules "
                 f"in its workers {median([r.report['warm'] for r in ddp_runs]):.2f} s (medians, outside the call); "
                 "a first import of torch._dynamo (DDP's constructor, in each fresh worker's call) took "
                 + (f"{dynamo:.2f} s here" if dynamo is not None else "(not measured: imported already)"))
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="tasks.train:mlp_model with ctx.client None: tasks.mlp.fit in one process, torch.set_num_threads(2)",
        candidate=f"mlp_model with a LocalCluster(n_workers={WORKERS}, threads_per_worker=1) client: tasks.mlp_ddp "
                  "through conveyor.train.ddp.run_ddp, one gloo rank per worker, 1 torch thread each",
        repeats=repeats, metrics=metrics,
        setup={"data": "; ".join(f"{n:,} rows: {split}" for n, split in splits.items()),
               "params": f"{json.dumps(mlp)}; seed {seed}; the wide model: hidden {WIDE}; {os.cpu_count()} cores",
               "workers' worker_env": json.dumps(cpu_worker_env())},
        checks=[f"every process exited 0 and left nothing running; each side trained exactly {EPOCHS} epochs to a "
                "finite best valid loss below its initial one, the same weights (SHA-256) on every repetition",
                f"the DDP side ran {WORKERS} ranks with gloo, whose weights agree (tasks.mlp_ddp.train checks it)"],
        notes=notes,
    )
