"""preprocess-workers: ``tasks.preprocess:prepare`` on a Dask LocalCluster of 1 worker vs 2.

Synthetic HIGGS-shaped parquet parts (``conveyor.ingest.synthetic``, as ``configs/scale.yaml``
ingests them) are generated once; then ``prepare`` (clean, exact stratified split,
train statistics, standardise, write the three splits) runs against two LocalClusters
started beforehand (not measured): 1 worker process and 2 worker processes, one thread
each, as the ``cpu`` profile would be with ``n_workers: 1`` or ``2``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, timed
from benchmarks.stages import context, current, digest, read_parts

if TYPE_CHECKING:
    from distributed import Client

    from conveyor import StageContext

NAME = "preprocess-workers"
DESCRIPTION = "preprocess (dask.dataframe) of synthetic HIGGS-shaped data on a LocalCluster"
PARAMS: dict[str, Any] = {"preprocess": {"label": "target", "valid_fraction": 0.15, "test_fraction": 0.2}, "seed": 42}
BASELINE_WORKERS = 1
CANDIDATE_WORKERS = 2
BURN_TASKS, BURN_N = 8, 1_500_000  # the control: 8 independent tasks of ~0.15 s each on an idle core
WARM_UP_ROWS = 20_000


def preprocess_context(root: Path, raw: Path, out: Path, client: Client | None = None,
                       n_workers: int = 1) -> StageContext:
    """The StageContext of the reference ``preprocess`` stage (``PARAMS``) reading ``raw`` and writing ``out``."""
    return context("preprocess", root, params=PARAMS, deps={"data/raw": raw}, outs={"data/processed": out},
                   client=client, n_workers=n_workers)


def generate(raw: Path, rows: int, shards: int) -> None:
    """``shards`` parquet parts of ``rows`` synthetic rows in ``raw`` (as the ingest task writes them)."""
    from conveyor.ingest.parts import part_path
    from conveyor.ingest.synthetic import SyntheticSource, write_shard

    source = SyntheticSource(rows=rows, shards=shards, seed=42)
    raw.mkdir(parents=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        written = sum(pool.map(lambda i: write_shard(source, i, part_path(raw, i)), range(shards)))
    check(written == rows, f"generated {written} rows, expected {rows}")


def cpu_worker_env() -> dict[str, Any] | None:
    """The ``worker_env`` of the cpu profile of configs/scale.yaml (the reference pipeline at scale)."""
    import yaml

    profile: dict[str, Any] = yaml.safe_load((REPO / "configs" / "scale.yaml").read_text())["profiles"]["cpu"]
    return profile.get("worker_env")


def start_cluster(workers: int, stack: ExitStack, worker_env: Mapping[str, Any] | None = None) -> Client:
    """A LocalCluster of ``workers`` one-thread worker processes, their environment Dask's with
    ``worker_env`` over it, as a dask profile starts it (``conveyor.run.nanny_env``)."""
    from distributed import Client, LocalCluster

    from conveyor.run.nanny_env import undo_nanny_environ, worker_environ

    with worker_environ(worker_env), undo_nanny_environ():
        cluster = stack.enter_context(LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, memory_limit="6GiB", host="127.0.0.1",
            dashboard_address=":0", scheduler_kwargs={"dashboard": False}, silence_logs=logging.ERROR))
    client: Client = stack.enter_context(Client(cluster, set_as_default=False))
    client.wait_for_workers(workers, timeout=120)
    return client


def warm_imports() -> None:
    """What a first prepare imports in a worker (run on each worker in --quick mode instead of a warm-up run)."""
    import dask.dataframe  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import tasks.preprocess  # noqa: F401


def burn(n: int) -> int:
    """Pure-Python CPU work that holds the GIL: the control task, parallel only across processes."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def compute_seconds(records: list[dict[str, Any]]) -> float:
    """Seconds the workers spent computing tasks, summed, from a distributed task stream."""
    return sum(float(span["stop"] - span["start"]) for record in records for span in record.get("startstops", ())
               if span.get("action") == "compute")


def _same_stats(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal rows and class counts, and means/stds equal to 1e-12 relative."""
    if {k: v for k, v in a.items() if k not in ("mean", "std")} != {k: v for k, v in b.items()
                                                                   if k not in ("mean", "std")}:
        return False
    return all(math.isclose(a[key][f], b[key][f], rel_tol=1e-12, abs_tol=1e-15) for key in ("mean", "std")
               for f in a[key])


def run(config: Config, log: Callable[[str], None]) -> Result:
    rows, shards = (100_000, 4) if config.quick else (1_000_000, 16)
    repeats = config.reps(full=4, quick=1)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-preprocess-"))
    raw = root / "data" / "raw"
    warm_raw = root / "warm-up" / "raw"
    wall = Metric("wall time of prepare (s)")
    rate = Metric("rows/s", ratio="candidate/baseline", digits=0)
    busy = Metric("worker compute time, summed over tasks (s)")
    control = Metric(f"control: {BURN_TASKS} independent CPU tasks (s)")
    reference: dict[str, Any] = {}
    identical_stats = [True]
    runs = [0]
    try:
        log(f"{NAME}: generating {rows:,} synthetic rows in {shards} parts")
        generate(raw, rows, shards)
        if not config.quick:
            generate(warm_raw, WARM_UP_ROWS, 2)
        with ExitStack() as stack:
            log(f"{NAME}: starting LocalClusters of {BASELINE_WORKERS} and {CANDIDATE_WORKERS} workers")
            clients = {n: start_cluster(n, stack, cpu_worker_env()) for n in (BASELINE_WORKERS, CANDIDATE_WORKERS)}

            burn_expected = burn(BURN_N)

            def burn_all(workers: int) -> float:
                """The control: how much parallel CPU the machine gives 1 and 2 workers right now."""
                client = clients[workers]
                seconds, totals = timed(lambda: client.gather(client.map(burn, [BURN_N] * BURN_TASKS, pure=False)))
                check(totals == [burn_expected] * BURN_TASKS, f"{workers} worker(s): the control tasks returned "
                                                              f"{totals}")
                return seconds

            def prepare(workers: int, *, warm_up: bool = False) -> tuple[float, float]:
                from distributed import get_task_stream

                from tasks.preprocess import prepare as preprocess_prepare

                runs[0] += 1
                out = root / f"run-{runs[0]:03d}" / "data" / "processed"
                client = clients[workers]
                ctx = preprocess_context(root, warm_raw if warm_up else raw, out, client, workers)
                with current(client), get_task_stream(client=client) as stream:
                    seconds, _ = timed(lambda: preprocess_prepare(ctx))
                computing = compute_seconds(stream.data)
                if warm_up:
                    shutil.rmtree(out.parent.parent)
                    return seconds, computing
                stats = json.loads((out / "stats.json").read_text())
                splits = {split: digest(read_parts(out / split)) for split in ("train", "valid", "test")}
                check(sum(stats["rows"].values()) == rows, f"{workers} worker(s): split rows {stats['rows']} do not "
                                                           f"add up to {rows}")
                if not reference:
                    reference.update(stats=stats, splits=splits)
                check(splits == reference["splits"], f"{workers} worker(s): the written splits differ from the first "
                                                     f"run's: {splits} vs {reference['splits']}")
                check(_same_stats(stats, reference["stats"]), f"{workers} worker(s): stats.json differs from the "
                                                              "first run's")
                identical_stats[0] &= stats == reference["stats"]
                shutil.rmtree(out.parent.parent)
                return seconds, computing

            def side(workers: int) -> tuple[float, float, float]:
                return *prepare(workers), burn_all(workers)

            if config.quick:
                log(f"{NAME}: warm-up (imports in the workers)")
                for client in clients.values():
                    client.run(warm_imports)
                warm_imports()
            else:
                log(f"{NAME}: warm-up (one run each on {WARM_UP_ROWS:,} rows, not counted)")
                prepare(BASELINE_WORKERS, warm_up=True)
                prepare(CANDIDATE_WORKERS, warm_up=True)
            log(f"{NAME}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, lambda _i: side(BASELINE_WORKERS), lambda _i: side(CANDIDATE_WORKERS),
                                     log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall.baseline, wall.candidate = [b[0] for b in base], [c[0] for c in cand]
    rate.baseline = [rows / s for s in wall.baseline]
    rate.candidate = [rows / s for s in wall.candidate]
    busy.baseline, busy.candidate = [b[1] for b in base], [c[1] for c in cand]
    control.baseline, control.candidate = [b[2] for b in base], [c[2] for c in cand]
    serial = statistics.median(w - b for w, b in zip(wall.baseline, busy.baseline, strict=True))
    bound = statistics.median(wall.baseline) / (serial + statistics.median(busy.baseline) / CANDIDATE_WORKERS)
    split_rows = reference["stats"]["rows"]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"tasks.preprocess:prepare on a LocalCluster(n_workers={BASELINE_WORKERS}, threads_per_worker=1)",
        candidate=f"the same on a LocalCluster(n_workers={CANDIDATE_WORKERS}, threads_per_worker=1)",
        repeats=repeats, metrics=[wall, rate, busy, control],
        setup={"data": f"{rows:,} rows x 29 columns (float32 features, int64 label) in {shards} parquet parts, "
                       "conveyor.ingest.synthetic seed 42",
               "params": json.dumps(PARAMS),
               "clusters": "both started before the first measurement and kept for the benchmark (worker processes, "
                           "127.0.0.1, memory_limit 6GiB; the workers' environment as the cpu profile of "
                           f"configs/scale.yaml sets it, worker_env {json.dumps(cpu_worker_env())})",
               "warm-up": "imports in the workers (--quick)" if config.quick else
                          f"one run each on {WARM_UP_ROWS:,} other rows, not counted"},
        checks=[f"every run split all {rows:,} rows ({', '.join(f'{k} {v:,}' for k, v in split_rows.items())})",
                "every run wrote the same train/valid/test rows in the same order (content hash of the parquet "
                "parts) and the same stats.json (counts exactly; mean/std "
                + ("bit for bit" if identical_stats[0] else "to 1e-12 relative") + ")"],
        notes=["the ideal ratio is 2.00 on 2 otherwise idle cores; the client (graph building), the scheduler and "
               "the benchmark's own process share those cores, so expect less",
               f"with 1 worker, prepare's wall time minus the workers' compute time (what the client and scheduler "
               f"add, and does not shrink with more workers) is {serial:.1f} s (median): with perfect scaling of the "
               f"rest, {CANDIDATE_WORKERS} workers could reach {bound:.2f}x",
               "worker compute time: the same tasks in both runs, so its ratio is 1.00 unless each task ran slower "
               "with 2 workers (a ratio below 1: the cores were contended, by the other worker or other processes)",
               f"the control row runs {BURN_TASKS} independent pure-Python tasks on the same two clusters right after "
               "each prepare: its ratio is the parallel CPU the machine gave 2 workers over 1 at that moment (2.00 "
               "on an idle 2-core machine; near 1.00 when other work saturates the cores); read prepare's "
               "ratio against it"],
    )
