"""preprocess-workers: ``tasks.preprocess:prepare`` on a Dask LocalCluster of 1 worker vs 2.

Synthetic HIGGS-shaped parquet parts (as ``configs/scale.yaml`` ingests them), ``prepare`` interleaved on
two LocalClusters started beforehand (1 and 2 one-thread workers, the ``cpu`` profile's ``worker_env``).
The control row, 8 pure-Python tasks on the same clusters after each prepare, is the parallel CPU the
machine gave 2 workers over 1 then (2.00 idle). Checked: every run wrote the first run's splits
(content hash) and stats.json (means/stds to 1e-12 relative).
"""

from __future__ import annotations

import io
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
WORKERS = (1, 2)  # the baseline's and the candidate's
BURN_TASKS, BURN_N = 8, 1_500_000  # the control: 8 independent tasks of ~0.15 s each on an idle core
WARM_UP_ROWS = 20_000
SPLITS = ("train", "valid", "test")


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


def start_cluster(workers: int, stack: ExitStack, worker_env: Mapping[str, Any] | None = None,
                  **options: Any) -> Client:
    """``workers`` one-thread worker processes in Dask's environment with ``worker_env`` over it, as a profile."""
    from distributed import Client, LocalCluster

    from conveyor.run.nanny_env import undo_nanny_environ, worker_environ

    options = {"memory_limit": "6GiB", "silence_logs": logging.ERROR, **options}
    with worker_environ(worker_env), undo_nanny_environ():
        cluster = stack.enter_context(LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                   host="127.0.0.1", dashboard_address=":0",
                                                   scheduler_kwargs={"dashboard": False}, **options))
    client: Client = stack.enter_context(Client(cluster, set_as_default=False))
    client.wait_for_workers(workers, timeout=120)
    return client


def warm_imports() -> None:
    """What a first prepare imports in a worker (run on each worker in --quick mode instead of a warm-up run)."""
    import dask.dataframe  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import tasks.preprocess  # noqa: F401


def prepare_timed(report: dict[str, Any], root: Path, raw: Path, out: Path, client: Client | None = None,
                  n_workers: int = 1) -> None:
    """``prepare`` once, ``client`` current: ``report``'s ``seconds`` and ``messages`` (what it logged)."""
    from tasks.preprocess import prepare

    said = io.StringIO()
    handler, logger = logging.StreamHandler(said), logging.getLogger("benchmarks.preprocess")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with current(client):
            report["seconds"], _ = timed(lambda: prepare(preprocess_context(root, raw, out, client, n_workers)))
    finally:
        logger.removeHandler(handler)
        report["messages"] = said.getvalue().splitlines()


def burn(n: int) -> int:
    """Pure-Python CPU work that holds the GIL: the control task, parallel only across processes."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def _close(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal but for means/stds, which are equal to 1e-12 relative."""
    return {**a, "mean": b["mean"], "std": b["std"]} == b and all(
        math.isclose(a[k][f], b[k][f], rel_tol=1e-12, abs_tol=1e-15) for k in ("mean", "std") for f in a[k])


def run(config: Config, log: Callable[[str], None]) -> Result:
    from distributed import get_task_stream

    rows, shards = (100_000, 4) if config.quick else (1_000_000, 16)
    repeats = config.reps(full=4, quick=1)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-preprocess-"))
    raw, warm_raw = root / "data" / "raw", root / "warm-up" / "raw"
    reference: dict[str, Any] = {}
    exact = [True]
    try:
        log(f"{NAME}: generating {rows:,} synthetic rows in {shards} parts")
        generate(raw, rows, shards)
        with ExitStack() as stack:
            clients = {n: start_cluster(n, stack, cpu_worker_env()) for n in WORKERS}
            burned = burn(BURN_N)

            def side(workers: int, src: Path = raw) -> tuple[float, float, float]:
                """prepare's wall, the workers' compute seconds, the control's wall."""
                client, out = clients[workers], root / "run" / "processed"
                report: dict[str, Any] = {}
                with get_task_stream(client=client) as stream:
                    prepare_timed(report, root, src, out, client, workers)
                computing = sum(float(s["stop"] - s["start"]) for r in stream.data for s in r.get("startstops", ())
                                if s.get("action") == "compute")
                if src == raw:
                    stats = json.loads((out / "stats.json").read_text())
                    splits = {split: digest(read_parts(out / split)) for split in SPLITS}
                    check(sum(stats["rows"].values()) == rows, f"{workers} worker(s): split rows {stats['rows']}")
                    if not reference:
                        reference.update(stats=stats, splits=splits)
                    check(splits == reference["splits"], f"{workers} worker(s): other splits than the first run's")
                    check(_close(stats, reference["stats"]), f"{workers} worker(s): stats.json not the first run's")
                    exact[0] &= stats == reference["stats"]
                shutil.rmtree(out.parent)
                control, totals = timed(lambda: client.gather(client.map(burn, [BURN_N] * BURN_TASKS, pure=False)))
                check(totals == [burned] * BURN_TASKS, f"{workers} worker(s): the control tasks returned {totals}")
                return report["seconds"], computing, control

            if config.quick:
                for client in clients.values():
                    client.run(warm_imports)
            else:
                log(f"{NAME}: warm-up, one run each on {WARM_UP_ROWS:,} rows (not counted)")
                generate(warm_raw, WARM_UP_ROWS, 2)
                for n in WORKERS:
                    side(n, warm_raw)
            base, cand = interleaved(repeats, lambda _i: side(WORKERS[0]), lambda _i: side(WORKERS[1]), log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall, busy, control = (Metric(label, [b[k] for b in base], [c[k] for c in cand]) for k, label in enumerate(
        ("wall time of prepare (s)", "worker compute time, summed over tasks (s)",
         f"control: {BURN_TASKS} independent CPU tasks (s)")))
    rate = Metric("rows/s", [rows / s for s in wall.baseline], [rows / s for s in wall.candidate],
                  ratio="candidate/baseline", digits=0)
    serial = statistics.median(w - b for w, b in zip(wall.baseline, busy.baseline, strict=True))
    bound = statistics.median(wall.baseline) / (serial + statistics.median(busy.baseline) / WORKERS[1])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"tasks.preprocess:prepare on a LocalCluster(n_workers={WORKERS[0]}, threads_per_worker=1)",
        candidate=f"the same on a LocalCluster(n_workers={WORKERS[1]}, threads_per_worker=1)",
        repeats=repeats, metrics=[wall, rate, busy, control],
        setup={"data": f"{rows:,} rows x 29 columns (float32 features, int64 label) in {shards} parquet parts, "
                       "conveyor.ingest.synthetic seed 42", "params": json.dumps(PARAMS),
               "clusters": "both started before the first measurement, kept for the benchmark (127.0.0.1, "
                           f"memory_limit 6GiB, worker_env {json.dumps(cpu_worker_env())})",
               "warm-up": "imports in the workers (--quick)" if config.quick else
                          f"one run each on {WARM_UP_ROWS:,} other rows, not counted"},
        checks=[f"every run split all {rows:,} rows ("
                + ", ".join(f"{k} {v:,}" for k, v in reference["stats"]["rows"].items()) + ")",
                "every run wrote the same train/valid/test rows in the same order (content hash of the parquet "
                "parts) and the same stats.json (counts exactly; mean/std "
                + ("bit for bit" if exact[0] else "to 1e-12 relative") + ")"],
        notes=[f"with {WORKERS[0]} worker, prepare's wall time minus the workers' compute time (client and scheduler, "
               f"which more workers do not shrink) is {serial:.1f} s (median): with perfect scaling of the rest, "
               f"{WORKERS[1]} workers could reach {bound:.2f}x"],
    )
