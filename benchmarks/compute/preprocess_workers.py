"""preprocess-workers: ``tasks.preprocess:prepare`` on a Dask LocalCluster of 1 worker vs 2.

Two clusters of one-thread workers (the cpu profile's ``worker_env``) started beforehand, after a warm-up; the control
row, 8 pure-Python tasks after each prepare, is the parallel CPU 2 workers got (2.00 idle). Checked: every run split
all rows, wrote the first run's splits (content hash) and stats.json (means/stds to 1e-12), the control its sums.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import math
import shutil
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, scratch, timed
from benchmarks.stages import context, current, digest, read_parts
from conveyor import StageContext
from conveyor.ingest.parts import part_path
from conveyor.ingest.synthetic import SyntheticSource, write_shard
from conveyor.run.nanny_env import undo_nanny_environ, worker_environ
from tasks.preprocess import prepare

if TYPE_CHECKING:
    from distributed import Client

NAME = "preprocess-workers"
DESCRIPTION = "preprocess (dask.dataframe) of synthetic HIGGS-shaped data on a LocalCluster"
PARAMS: dict[str, Any] = {"preprocess": {"label": "target", "valid_fraction": 0.15, "test_fraction": 0.2}, "seed": 42}
WORKERS = (1, 2)  # the baseline's and the candidate's
BURN_TASKS, BURN_N = 8, 1_500_000  # the control: 8 independent tasks of ~0.15 s each on an idle core


def preprocess_context(root: Path, raw: Path, out: Path, client: Client | None = None,
                       n_workers: int = 1) -> StageContext:
    """The StageContext of the reference ``preprocess`` stage (``PARAMS``) reading ``raw`` and writing ``out``."""
    return context("preprocess", root, params=PARAMS, deps={"data/raw": raw}, outs={"data/processed": out},
                   client=client, n_workers=n_workers)


def generate(raw: Path, rows: int, shards: int) -> None:
    """``shards`` parquet parts of ``rows`` synthetic rows in ``raw`` (as the ingest task writes them)."""
    source = SyntheticSource(rows=rows, shards=shards, seed=42)
    raw.mkdir(parents=True)
    written = sum(write_shard(source, i, part_path(raw, i)) for i in range(shards))
    check(written == rows, f"generated {written} rows, expected {rows}")


def cpu_worker_env() -> dict[str, Any] | None:
    """The ``worker_env`` of the cpu profile of configs/scale.yaml (the reference pipeline at scale)."""
    profile: dict[str, Any] = yaml.safe_load((REPO / "configs" / "scale.yaml").read_text())["profiles"]["cpu"]
    return profile.get("worker_env")


def start_cluster(workers: int, stack: ExitStack, worker_env: Mapping[str, Any] | None = None,
                  **options: Any) -> Client:
    """``workers`` one-thread worker processes in Dask's environment with ``worker_env`` over it, as a profile."""
    from distributed import Client, LocalCluster
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
    for module in ("dask.dataframe", "pyarrow.parquet", "tasks.preprocess"):
        importlib.import_module(module)


def prepare_timed(report: dict[str, Any], root: Path, raw: Path, out: Path, client: Client | None = None,
                  n_workers: int = 1) -> None:
    """``prepare`` once, ``client`` current: ``report``'s ``seconds`` and ``messages`` (what it logged)."""
    said, logger = io.StringIO(), logging.getLogger("benchmarks.preprocess")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler := logging.StreamHandler(said))
    with current(client):
        report["seconds"], _ = timed(lambda: prepare(preprocess_context(root, raw, out, client, n_workers)))
    logger.removeHandler(handler)
    report["messages"] = said.getvalue().splitlines()


def burn(n: int) -> int:
    """Pure-Python CPU work that holds the GIL: the control task, parallel only across processes."""
    return sum(i * i % 7 for i in range(n))


def run(config: Config, log: Callable[[str], None]) -> Result:
    from distributed import get_task_stream
    (rows, shards), repeats = (100_000, 4) if config.quick else (1_000_000, 16), config.reps(full=4, quick=1)
    reference: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
    with scratch(NAME) as root, ExitStack() as stack:
        raw, warm, out = root / "data" / "raw", root / "warm-up" / "raw", root / "run" / "processed"
        generate(raw, rows, shards)
        clients = {n: start_cluster(n, stack, cpu_worker_env()) for n in WORKERS}
        burned = burn(BURN_N)

        def side(workers: int, src: Path = raw) -> tuple[float, float, float]:
            client, report = clients[workers], dict[str, Any]()
            with get_task_stream(client=client) as stream:
                prepare_timed(report, root, src, out, client, workers)
            computing = sum(float(s["stop"] - s["start"]) for r in stream.data for s in r.get("startstops", ())
                            if s.get("action") == "compute")
            if src == raw:
                stats = json.loads((out / "stats.json").read_text())
                splits = {split: digest(read_parts(out / split)) for split in ("train", "valid", "test")}
                check(sum(stats["rows"].values()) == rows, f"{workers} worker(s): split rows {stats['rows']}")
                first, digests = reference.setdefault("first", (stats, splits))
                check(splits == digests, f"{workers} worker(s): other splits than the first run's")
                check({**stats, "mean": first["mean"], "std": first["std"]} == first and all(math.isclose(
                    stats[k][f], first[k][f], rel_tol=1e-12, abs_tol=1e-15) for k in ("mean", "std") for f in stats[k]),
                      f"{workers} worker(s): stats.json not the first run's (means/stds to 1e-12 relative)")
            shutil.rmtree(out.parent)
            control, totals = timed(lambda: client.gather(client.map(burn, [BURN_N] * BURN_TASKS, pure=False)))
            check(totals == [burned] * BURN_TASKS, f"{workers} worker(s): the control tasks returned {totals}")
            return report["seconds"], computing, control

        generate(warm, 20_000, 2)  # the warm-up: a run each on other rows, not counted (--quick: the imports)
        for n, client in clients.items():
            if config.quick:
                client.run(warm_imports)
            else:
                side(n, warm)
        base, cand = interleaved(repeats, lambda _i: side(WORKERS[0]), lambda _i: side(WORKERS[1]), log)
    wall, busy, control = (Metric(label, [b[k] for b in base], [c[k] for c in cand]) for k, label in enumerate((
        "wall time of prepare (s)", "worker compute time, summed over tasks (s)",
        f"control: {BURN_TASKS} independent CPU tasks (s)")))
    rate = Metric("rows/s", [rows / s for s in wall.baseline], [rows / s for s in wall.candidate],
                  ratio="candidate/baseline", digits=0)
    return Result(NAME, DESCRIPTION, f"tasks.preprocess:prepare on a LocalCluster(n_workers={WORKERS[0]}, "
                  f"threads_per_worker=1)", f"the same on a LocalCluster(n_workers={WORKERS[1]}, threads_per_worker=1)",
                  repeats, [wall, rate, busy, control], setup={"data": f"{rows:,} rows in {shards} parts"})
