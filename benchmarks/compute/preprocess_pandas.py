"""preprocess-pandas: the preprocess stage (dask.dataframe) vs the same steps in one pandas process.

The question: what does a user gain, or pay, running the reference project's preprocess
task ``tasks.preprocess:prepare`` (clean, exact stratified hash split, train statistics,
standardise, write train/valid/test parquet and stats.json) instead of the script they
would write? Three sides, each a fresh process per measurement (the same page cache,
imports done before the clock starts), on synthetic HIGGS-shaped parquet parts
(``conveyor.ingest.synthetic``, seed 42, as ``preprocess-workers`` generates them; one part
per 62,500 rows: 16 parts at 1,000,000 rows):

- baseline, pandas: ``benchmarks/compute/plain_preprocess.py``: every part read with pandas into
  one frame, then the task's own per-partition helpers (split keys, cut points, tagging,
  statistics, standardising) applied to the whole frame, one ``part-00000.parquet`` per
  split and stats.json written with the task's ``_summary``. No dask, no conveyor.
- candidate, in process: ``prepare(ctx)`` with ``ctx.client = None``, what a stage placed
  in conveyor's process gets: dask's local scheduler in this process (the task reads small
  data at once, as one partition; see the note on which way it went per size).
- candidate, 2 workers: ``prepare(ctx)`` with a ``LocalCluster(n_workers=2,
  threads_per_worker=1, processes=True)`` as the current client, started in the same
  process before the clock starts (its start-up, and importing the task in the workers,
  is in a note: what a run pays on top when it starts the cluster for the stage).

The wall of the work is timed inside each process (pandas: from the first read to
stats.json written; conveyor: ``prepare`` alone); the whole process's wall (interpreter,
imports, cluster start and stop) is in a note. Peak memory is the summed RSS of the
process tree (for the 2-worker side: the client process, which also runs the scheduler,
the nannies and the workers), sampled by psutil every 100 ms over the whole process
(timed by hyperfine). The sides rotate (P I C, I C P, C P I, ...).

Before any ratio: every process exits 0 and leaves nothing running; the pandas side
imported none of dask, distributed, conveyor, prefect; every run split all rows with the
same per-split counts; each conveyor run wrote the pandas rows (sorted row-wise, within
``TOLERANCE`` of a train std) and stats.json (means and stds within ``TOLERANCE``).
"""

from __future__ import annotations

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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Config, Metric, Result, check, met, rows_label, side_command, timed
from benchmarks.projects import SideRun, run_side

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from distributed import Client

NAME = "preprocess-pandas"
DESCRIPTION = "preprocess (dask.dataframe) in process and on 2 workers vs the same steps in one pandas process"
PLAIN = Path(__file__).resolve().parent / "plain_preprocess.py"
PANDAS, IN_PROCESS, CLUSTER, DASK_ENV = "pandas", "in-process", "cluster", "cluster-dask-env"
SIDES = (PANDAS, IN_PROCESS, CLUSTER, DASK_ENV)
CLUSTERS = (CLUSTER, DASK_ENV)
FULL_SIZES = (100_000, 1_000_000, 4_000_000)
QUICK_SIZES = (100_000, 300_000)
ROWS_PER_PART = 62_500
WARM_UP_ROWS = 20_000
WORKERS = 2
SPLITS = ("train", "valid", "test")
TOLERANCE = 1e-9  # in train standard deviations (statistics are summed in float64 on every side)
GOAL_ROWS, GOAL_RATIO = 1_000_000, 1.5  # the issue: 2 workers at least 1.5x faster than pandas at 1M rows
EXACT_KEYS = ("label", "features", "seed", "fractions", "ddof", "rows", "class_counts")


def parts_for(rows: int) -> int:
    """Parquet parts for ``rows`` rows: one per ``ROWS_PER_PART`` (16 at 1,000,000), at least 1."""
    return max(1, math.ceil(rows / ROWS_PER_PART))


# --- one side, in its own process ---------------------------------------------------------


class _Messages(logging.Handler):
    """The task's log lines (which way ``prepare`` read the data), kept for the notes."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def side_main(argv: list[str]) -> int:
    """``in-process|cluster RAW OUT``: run ``prepare`` once; print one JSON line of seconds.

    ``seconds``: prepare alone; ``imports``; for the cluster, ``start`` (LocalCluster up,
    both workers registered), ``warm`` (the task's modules imported in the workers) and
    ``close``; ``messages``: what prepare logged.
    """
    began = time.perf_counter()
    side, raw, out = argv[0], Path(argv[1]).resolve(), Path(argv[2]).resolve()
    if side not in (IN_PROCESS, *CLUSTERS):
        raise SystemExit(f"preprocess_pandas: unknown side {side!r}, expected {IN_PROCESS}, {', '.join(CLUSTERS)}")
    from benchmarks.compute.preprocess_workers import cpu_worker_env, preprocess_context, start_cluster, warm_imports
    from benchmarks.stages import current
    from tasks.preprocess import prepare

    warm_imports()
    messages = _Messages()
    logger = logging.getLogger("benchmarks.preprocess")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    report: dict[str, Any] = {"side": side, "imports": time.perf_counter() - began}
    with ExitStack() as stack:
        client: Client | None = None
        if side in CLUSTERS:
            env = cpu_worker_env() if side == CLUSTER else None
            report["start"], started = timed(lambda: start_cluster(WORKERS, stack, env))
            report["warm"], _ = timed(lambda: started.run(warm_imports))
            client = started
        ctx = preprocess_context(out.parent, raw, out, client, WORKERS if client is not None else 1)
        with current(client):
            report["seconds"], _ = timed(lambda: prepare(ctx))
        closing = time.perf_counter()
    report["close"] = time.perf_counter() - closing
    report["messages"] = messages.lines
    print(json.dumps(report), flush=True)
    return 0


# --- the outputs ----------------------------------------------------------------------------


@dataclass
class Outputs:
    """What one run wrote: stats.json and, per split, its columns and rows sorted row-wise."""

    stats: dict[str, Any]
    columns: dict[str, list[str]] = field(default_factory=dict)
    rows: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


def observe(out: Path, side: str, *, rows_in: int, sort: bool) -> Outputs:
    """Read a run's outputs; check its row counts against its stats.json and the input."""
    import numpy as np

    from benchmarks.stages import digest, read_parts

    check((out / "stats.json").is_file(), f"{side}: wrote no stats.json")
    outputs = Outputs(stats=json.loads((out / "stats.json").read_text()))
    said = outputs.stats["rows"]
    check(sum(said.values()) == rows_in, f"{side}: stats.json splits {said}, which do not add up to {rows_in:,} rows")
    for split in SPLITS:
        frame = read_parts(out / split)
        check(len(frame) == said[split], f"{side}: {split} holds {len(frame):,} rows, stats.json says {said[split]:,}")
        outputs.digests[split] = digest(frame)
        if sort:
            values = frame.to_numpy(dtype=np.float64)
            # exact values: each side maps a raw value monotonically, so all sides sort the raw rows' order
            outputs.columns[split] = [str(c) for c in frame.columns]
            outputs.rows[split] = values[np.lexsort(values.T[::-1])]
    return outputs


@dataclass
class Agreement:
    """The largest differences seen between a conveyor side and pandas, in train std units."""

    rows: float = 0.0
    mean: float = 0.0
    std: float = 0.0


def compare(reference: Outputs, outputs: Outputs, side: str, agreement: Agreement) -> None:
    """``outputs`` hold the reference's rows and statistics, within ``TOLERANCE``."""
    import numpy as np

    ref, got = reference.stats, outputs.stats
    for key in EXACT_KEYS:
        check(got[key] == ref[key], f"{side}: stats.json {key} differs from pandas': {got[key]} vs {ref[key]}")
    for f in ref["features"]:
        scale = ref["std"][f]
        mean, std = abs(got["mean"][f] - ref["mean"][f]) / scale, abs(got["std"][f] - ref["std"][f]) / scale
        check(mean <= TOLERANCE and std <= TOLERANCE, f"{side}: stats.json {f}: mean {got['mean'][f]!r} vs "
                                                      f"{ref['mean'][f]!r}, std {got['std'][f]!r} vs {ref['std'][f]!r} "
                                                      f"(pandas): more than {TOLERANCE:g} of a std apart")
        agreement.mean, agreement.std = max(agreement.mean, mean), max(agreement.std, std)
    label = str(ref["label"])
    for split in SPLITS:
        columns, want, have = reference.columns[split], reference.rows[split], outputs.rows[split]
        check(outputs.columns[split] == columns, f"{side}: {split} columns {outputs.columns[split]} vs {columns}")
        check(have.shape == want.shape, f"{side}: {split} has {have.shape} rows x columns, pandas {want.shape}")
        at = columns.index(label)
        check(bool(np.array_equal(have[:, at], want[:, at])), f"{side}: {split} labels differ from pandas' (sorted)")
        check(bool(np.array_equal(np.isnan(have), np.isnan(want))), f"{side}: {split} missing values differ")
        diff = float(np.nanmax(np.abs(have - want))) if have.size else 0.0
        check(diff <= TOLERANCE, f"{side}: {split} rows (sorted) differ from pandas' by up to {diff:g} (standardised "
                                 f"values; tolerance {TOLERANCE:g})")
        agreement.rows = max(agreement.rows, diff)


# --- the benchmark --------------------------------------------------------------------------


@dataclass
class Size:
    """Everything measured at one number of rows."""

    rows: int
    parts: int
    raw_mib: float
    runs: dict[str, list[SideRun]] = field(default_factory=lambda: {side: [] for side in SIDES})

    def seconds(self, side: str) -> list[float]:
        return [r.seconds for r in self.runs[side]]

    def median(self, side: str, what: str = "seconds") -> float:
        return statistics.median(float(getattr(r, what)) for r in self.runs[side])


def measure(side: str, raw: Path, out: Path) -> SideRun:
    """One fresh process of ``side`` on ``raw``, writing ``out``."""
    from benchmarks.compute.preprocess_workers import PARAMS
    if side == PANDAS:
        params = PARAMS["preprocess"]
        args = [sys.executable, str(PLAIN), str(raw), str(out), "--label", str(params["label"]),
                "--valid", str(params["valid_fraction"]), "--test", str(params["test_fraction"]),
                "--seed", str(PARAMS["seed"])]
    else:
        args = side_command("benchmarks.compute.preprocess_pandas", side, str(raw), str(out))
    done = run_side(args, side)
    if side == PANDAS:
        check(done.report["forbidden"] == [], f"pandas: the plain script imported {done.report['forbidden']}")
    return done


def run(config: Config, log: Callable[[str], None]) -> Result:
    from benchmarks.compute.preprocess_workers import generate

    sizes = QUICK_SIZES if config.quick else FULL_SIZES
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-preprocess-pandas-"))
    agreement = Agreement()
    measured: list[Size] = []
    counter = [0]

    def one(side: str, raw: Path, rows: int, reference: list[Outputs]) -> SideRun:
        """Measure ``side``, check what it wrote against the pandas reference, remove it."""
        counter[0] += 1
        out = scratch / f"run-{counter[0]:03d}-{side}" / "processed"
        result = measure(side, raw, out)
        if side == PANDAS:
            outputs = observe(out, side, rows_in=rows, sort=not reference)
            if not reference:
                reference.append(outputs)
            check(outputs.digests == reference[0].digests and outputs.stats == reference[0].stats,
                  "pandas: this run wrote other rows or statistics than the first pandas run")
        else:
            check(bool(reference), f"{side}: ran before any pandas run (no reference)")
            compare(reference[0], observe(out, side, rows_in=rows, sort=True), side, agreement)
        shutil.rmtree(out.parent)
        return result

    try:
        log(f"{NAME}: warm-up, each side once on {WARM_UP_ROWS:,} rows (not counted)")
        warm_raw = scratch / "warm-up-raw"
        generate(warm_raw, WARM_UP_ROWS, 2)
        warm_reference: list[Outputs] = []
        for side in SIDES:
            one(side, warm_raw, WARM_UP_ROWS, warm_reference)
        shutil.rmtree(warm_raw)
        for rows in sizes:
            raw = scratch / f"raw-{rows}"
            parts = parts_for(rows)
            log(f"{NAME}: generating {rows:,} synthetic rows in {parts} parts")
            generate(raw, rows, parts)
            size = Size(rows, parts, sum(p.stat().st_size for p in raw.glob("*.parquet")) / 2**20)
            reference: list[Outputs] = []
            log(f"{NAME}: {rows:,} rows ({size.raw_mib:.0f} MiB of parquet): {repeats} rotating repetitions")
            for i in range(repeats):
                for side in SIDES[i % len(SIDES):] + SIDES[:i % len(SIDES)]:
                    done = one(side, raw, rows, reference)
                    size.runs[side].append(done)
                    log(f"  {rows_label(rows)} repetition {i + 1}/{repeats} {side}: {done.seconds:.2f} s of work, "
                        f"{done.wall:.2f} s process, {done.peak_mib:.0f} MiB")
            measured.append(size)
            del reference
            shutil.rmtree(raw)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(config, repeats, measured, agreement)


def _result(config: Config, repeats: int, sizes: list[Size], agreement: Agreement) -> Result:
    from benchmarks.compute.preprocess_workers import cpu_worker_env

    metrics: list[Metric] = []
    ratios: dict[int, float] = {}
    for size in sizes:
        label = rows_label(size.rows)
        pandas_s = size.seconds(PANDAS)
        in_process = Metric(f"{label} rows: wall of the work (s), pandas vs in process", pandas_s,
                            size.seconds(IN_PROCESS))
        cluster = Metric(f"{label} rows: wall of the work (s), pandas vs 2 workers", pandas_s, size.seconds(CLUSTER))
        dask_env = Metric(f"{label} rows: wall of the work (s), pandas vs 2 workers in Dask's worker environment",
                          pandas_s, size.seconds(DASK_ENV))
        ratios[size.rows] = statistics.median(cluster.ratios())
        pandas_mib = [r.peak_mib for r in size.runs[PANDAS]]
        metrics += [in_process, cluster, dask_env,
                    Metric(f"{label} rows: peak RSS of the process tree (MiB), pandas vs in process", pandas_mib,
                           [r.peak_mib for r in size.runs[IN_PROCESS]], digits=0),
                    Metric(f"{label} rows: peak RSS of the process tree (MiB), pandas vs 2 workers", pandas_mib,
                           [r.peak_mib for r in size.runs[CLUSTER]], digits=0)]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="pandas: `python benchmarks/compute/plain_preprocess.py`, the same steps on one frame in one process",
        candidate="tasks.preprocess:prepare in a fresh process, in process (ctx.client None) or on a 2-worker "
                  "LocalCluster started beforehand, as each metric says",
        repeats=repeats, metrics=metrics,
        setup={"data": ", ".join(f"{s.rows:,} rows in {s.parts} parts ({s.raw_mib:.0f} MiB)" for s in sizes),
               "2 workers' worker_env": json.dumps(cpu_worker_env()), "warm-up rows": f"{WARM_UP_ROWS:,}",
               "cores": str(os.cpu_count())},
        checks=["every process exited 0 and left no process of its group running",
                "the pandas side imported none of dask, distributed, conveyor, prefect",
                "every run of every side split all rows with the same per-split row and class counts (stats.json, and "
                "the rows of the written parts)",
                "every pandas run wrote the same rows in the same order (content hash) and the same stats.json",
                f"each conveyor run wrote the same rows as pandas, compared sorted row-wise: labels equal, "
                f"standardised features within {TOLERANCE:g} (observed at most {agreement.rows:.2g})",
                f"stats.json: label, features, seed, fractions, ddof, rows and class counts equal to pandas'; each "
                f"feature's mean and std within {TOLERANCE:g} of its std (observed at most {agreement.mean:.2g} and "
                f"{agreement.std:.2g})"],
        notes=_notes(config, sizes, ratios, agreement),
    )


def _notes(config: Config, sizes: list[Size], ratios: dict[int, float], agreement: Agreement) -> list[str]:
    notes = []
    for size in sizes:
        walls = (size.median(side, "wall") for side in (PANDAS, IN_PROCESS, CLUSTER))
        notes.append(f"{size.rows:,} rows, the whole process (medians): pandas, in process, 2 workers: "
                     + ", ".join(f"{wall:.2f} s" for wall in walls))
    wins = [f"{size.rows:,} rows ({ratios[size.rows]:.2f}x)" for size in sizes if ratios[size.rows] > 1]
    best = max(sizes, key=lambda s: ratios[s.rows])
    notes.append(f"the 2-worker cluster beats pandas at {', '.join(wins)}" if wins else
                 f"the 2-worker cluster beats pandas at no size measured (closest: {ratios[best.rows]:.2f}x at "
                 f"{best.rows:,} rows)")
    verdict = (f"{met(ratios[GOAL_ROWS] >= GOAL_RATIO)} ({ratios[GOAL_ROWS]:.2f}x)" if GOAL_ROWS in ratios else
               f"not measured (this run: {', '.join(f'{s.rows:,}' for s in sizes)} rows)")
    notes.append(f"goal (the issue): at {GOAL_ROWS:,} rows on 2 workers at least {GOAL_RATIO}x faster than pandas: "
                 + verdict)
    for size in sizes:
        notes.append(f"{size.rows:,} rows on 2 workers: {size.median(CLUSTER):.2f} s with the profile's worker_env, "
                     f"{size.median(DASK_ENV):.2f} s in Dask's worker environment (MALLOC_TRIM_THRESHOLD_ 65536: glibc "
                     "hands every freed array back to the kernel and faults fresh pages in for the next)")
    cluster_runs = [r for size in sizes for side in CLUSTERS for r in size.runs[side]]
    start = statistics.median(float(r.report["start"]) for r in cluster_runs)
    warm = statistics.median(float(r.report["warm"]) for r in cluster_runs)
    close = statistics.median(float(r.report["close"]) for r in cluster_runs)
    notes.append(f"starting the 2-worker LocalCluster (until both workers registered) took {start:.2f} s, importing "
                 f"the task's modules in the workers {warm:.2f} s, closing it {close:.2f} s (medians over "
                 f"{len(cluster_runs)} runs): what a run pays on top of the work when it starts the cluster for the "
                 "stage (not in the wall of the work)")
    for size in sizes:
        said = sorted({line for r in size.runs[IN_PROCESS] for line in r.report["messages"]
                       if not line.startswith("split rows")})
        notes.append(f"in process at {size.rows:,} rows ({size.raw_mib:.0f} MiB of parquet in {size.parts} parts), "
                     f"prepare said: " + ("; ".join(repr(line) for line in said) if said else
                                          "nothing about reading at once (dask's threaded scheduler on the parts)"))
    notes.append(
        f"agreement with pandas: standardised values within {agreement.rows:.2g}, means within {agreement.mean:.2g} "
        f"and stds within {agreement.std:.2g} of a std (the order of float64 sums, partitioned or not)")
    return notes


if __name__ == "__main__":
    sys.exit(side_main(sys.argv[1:]))
