"""memory-cap: from which data size one process no longer fits a per-process memory cap, and 2 Dask workers do.

The question (issue 14, "Done when"): on this 2-core machine the Dask preprocess and
xgboost.dask are slower than one pandas/xgboost process at every size measured
(``preprocess-pandas``, ``xgboost-dask``). What Dask gives instead is memory bounded per
process: a worker holds a few partitions, not the data. So: under the same memory cap per
process, from which number of rows does the single process no longer complete while the
2-worker Dask cluster still does?

The cap ``C`` is enforced alike on every process of both sides, with the rule Dask's nanny
applies to its worker: a process whose RSS (psutil, the kernel's VmRSS) exceeds
``distributed.worker.memory.terminate`` (0.95) of ``C`` is killed, checked every
``SAMPLE_S``. The Dask workers get ``memory_limit=C``, so their nanny (in the client's
process, its check made as frequent as the sampler's) restarts a worker above 0.95 C; the
worker itself spills to disk at 0.6-0.7 C and pauses at 0.8 C, Dask's defaults. Every other
process, the single process of the baseline and the Dask side's client (which also runs
the scheduler and the nannies), is watched by this benchmark's sampler and its process
group SIGKILLed above the same 0.95 C. Address-space limits (RLIMIT_AS, RLIMIT_DATA) are
not used: pyarrow's and glibc's reserved address space trips them far below real use.
``C`` is 1.25 GiB (``--quick``: 640 MiB), chosen so that the crossover falls inside the
sizes measured: 1, 2, 4 and 10 million rows for preprocess (10M rows are 1.34 GiB in memory,
more than one worker's cap), 1, 2 and 4 million for xgboost (``--quick``: 250k, 500k, 1M and
250k, 500k).

Two tasks, each side a fresh process per measurement, sizes ascending:

- preprocess. Baseline: ``benchmarks/compute/plain_preprocess.py RAW OUT``, the same steps in one
  pandas process (``preprocess-pandas``'s baseline). Candidate: ``tasks.preprocess:prepare``
  on a ``LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=C)``, started in the
  process before the clock. Input: synthetic HIGGS-shaped parquet parts (seed 42, one part
  per 62,500 rows, as ``preprocess-pandas`` generates them).
- xgboost. Baseline: ``conveyor.train.xgb.train_xgboost(None, ...)``, ``xgb.train(nthread=2)``
  in one process (``xgboost-dask``'s baseline side, unchanged). Candidate:
  ``train_xgboost(client, ...)``, xgboost.dask, on the same capped cluster. Input: the
  splits the candidate's preprocess wrote at that size (parts of about 40,000 rows, as the
  pipeline's train stage reads them); params: the reference project's ``train.xgb``.

A run completed when its process exited 0 and was not killed, and, on the Dask side, when
no worker was restarted or killed while it ran (a nanny's restart interrupts the run at
once: it counts as not completed even where Dask would have retried) and the run ended
within a deadline (a worker paused above 0.8 C for good would otherwise wait forever).
Completion does not depend on the machine's load as a timing does: one repetition per size
and side (``--repeats`` raises it); no warm-up run.

Before reporting: every completed preprocess run split all its input rows (stats.json and
the written parts agree); where both sides completed, the Dask side wrote the pandas side's
rows and statistics (as ``preprocess-pandas`` checks them); every completed xgboost run
learned (best valid logloss below ln 2), and where both completed their best valid
logloss are within ``xgboost-dask``'s 2 % of each other; the Dask side's client process
stayed below ``CLIENT_SHARE`` of ``C``; every process ended (a killed side's whole group).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import REPO, Config, Result, check, rows_label, side_command, side_report

if TYPE_CHECKING:

    from benchmarks.compute.preprocess_pandas import Agreement, Outputs

NAME = "memory-cap"
DESCRIPTION = ("under one memory cap per process: from which size one pandas/xgboost process no longer completes "
               "and a 2-worker Dask cluster does")
MIB, GIB = 2**20, 2**30
FULL_CAP, QUICK_CAP = 5 * GIB // 4, 640 * MIB
FULL_PREPROCESS, QUICK_PREPROCESS = (1_000_000, 2_000_000, 4_000_000, 10_000_000), (250_000, 500_000, 1_000_000)
FULL_XGBOOST, QUICK_XGBOOST = (1_000_000, 2_000_000, 4_000_000), (250_000, 500_000)
FULL_DEADLINE_S, QUICK_DEADLINE_S = 300.0, 120.0  # a Dask side still running then is stopped: not completed
WORKERS = 2
SAMPLE_S = 0.05  # the sampler's period, and the nannies' (distributed.worker.memory.monitor-interval)
CLIENT_SHARE = 0.8  # the Dask side's client process must stay below this share of the cap (a worker pauses there)
MARGIN = 0.05  # a completed run whose largest process came this close to the kill threshold is flagged as marginal
LEARNED = math.log(2)  # a model that learned nothing scores about ln 2 (balanced classes)
PREPROCESS, XGBOOST = "preprocess", "xgboost"
SINGLE, CLUSTER = "single", "cluster"
SIDE_NAMES = {(PREPROCESS, SINGLE): "pandas", (PREPROCESS, CLUSTER): "Dask, 2 workers",
              (XGBOOST, SINGLE): "xgb.train", (XGBOOST, CLUSTER): "xgboost.dask, 2 workers"}
# what the workers and nannies log about memory, counted in the Dask side's stderr
LOGGED = {"paused": "Pausing worker", "unmanaged memory high": "Unmanaged memory use is high",
          "restarted": "Restarting worker", "over the terminate threshold": "memory budget. Restarting"}


def terminate_fraction() -> float:
    """Dask's ``distributed.worker.memory.terminate``: the share of ``memory_limit`` above which a worker is killed."""
    import dask
    import distributed  # noqa: F401 - registers distributed's configuration defaults

    fraction = dask.config.get("distributed.worker.memory.terminate")
    check(isinstance(fraction, float) and 0 < fraction <= 1, f"distributed.worker.memory.terminate is {fraction!r}")
    return float(fraction)


def fractions() -> dict[str, float]:
    import dask
    import distributed  # noqa: F401 - registers distributed's configuration defaults

    return {key: float(dask.config.get(f"distributed.worker.memory.{key}"))
            for key in ("target", "spill", "pause", "terminate")}


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def _cap(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:g} MiB"


# --- one measurement, from outside ---------------------------------------------------------


@dataclass
class Outcome:
    """One measurement of one side at one size."""

    task: str
    side: str
    rows: int
    out: Path  # where it wrote (preprocess: out/processed)
    completed: bool = False
    reason: str = ""
    wall: float = 0.0  # the whole process, from outside
    seconds: float = math.nan  # the work, timed inside; NaN unless completed
    largest: float = 0.0  # the largest RSS of any one process of the side, bytes
    root: float = 0.0  # the process started (the Dask side: client, scheduler and nannies)
    others: float = 0.0  # the largest of its descendants (the Dask side: a worker)
    tree: float = 0.0  # the summed RSS of the process tree
    killed_at: float = 0.0  # seconds into the run when killed above the cap, else 0
    report: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, int] = field(default_factory=dict)  # the Dask side's memory warnings, counted

    @property
    def name(self) -> str:
        return SIDE_NAMES[self.task, self.side]

    def verdict(self) -> str:
        if self.completed:
            return (f"completed ({self.seconds:.1f} s of work, {self.wall:.1f} s process; largest process "
                    f"{_mib(self.largest)})")
        return f"did NOT complete: {self.reason}"


def launch(outcome: Outcome, args: list[str], cap: int, deadline: float, *, capped_all: bool) -> Outcome:
    """Run ``args`` in a process group of its own, its tree's RSS sampled by psutil every ``SAMPLE_S``.
    The whole group is SIGKILLed when a capped process goes over the terminate fraction of ``cap``
    (``capped_all``: every process of the tree; else the one started: the Dask side's workers are
    their nannies' to stop) or after ``deadline`` + 60 s; reaped either way."""
    from benchmarks.processes import Sampler, stop_group
    from benchmarks.projects import repo_env

    limit = terminate_fraction() * cap
    started = time.perf_counter()

    def watch(sizes: dict[int, int]) -> None:
        root = sizes.pop(proc.pid, 0)
        outcome.root, outcome.others = max(outcome.root, root), max([outcome.others, *sizes.values()])
        outcome.tree = max(outcome.tree, root + sum(sizes.values()))
        largest = max([root, *sizes.values()] if capped_all else [root])
        if largest > limit and not outcome.reason:
            outcome.killed_at = time.perf_counter() - started
            outcome.reason = (f"killed above the cap: a process at {_mib(largest)} > {terminate_fraction():g} x "
                              f"{_cap(cap)} after {outcome.killed_at:.1f} s")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(args, cwd=REPO, env=repo_env(), stdout=stdout, stderr=stderr, start_new_session=True)
        with Sampler(proc.pid, SAMPLE_S, on_sample=watch):
            try:
                proc.wait(timeout=deadline + 60)
            except subprocess.TimeoutExpired:
                outcome.reason = outcome.reason or f"killed: still running {deadline + 60:.0f} s after it started"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        outcome.wall = time.perf_counter() - started
        left = stop_group(proc.pid, grace_s=10)
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
    outcome.largest = max(outcome.root, outcome.others)
    outcome.logged = {what: err.count(text) for what, text in LOGGED.items()}
    if outcome.reason:
        return outcome
    check(not left, f"{outcome.name}: processes of its group were still running 10 s after it exited (killed)")
    if proc.returncode != 0:
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["(no stderr)"]
        outcome.reason = f"error: exit status {proc.returncode}: {tail[0][:300]}"
        return outcome
    outcome.report = side_report(out, outcome.name)
    outcome.reason = str(outcome.report.get("reason", ""))
    if outcome.reason and outcome.logged["paused"]:
        outcome.reason += (f" (the workers paused {outcome.logged['paused']}x above {fractions()['pause']:g} of the "
                           "cap: a paused worker runs no task until its memory falls)")
    outcome.completed = bool(outcome.report.get("completed", True)) and not outcome.reason
    if outcome.completed:
        outcome.seconds = float(outcome.report["seconds"])
    return outcome


def measure(task: str, side: str, rows: int, src: Path, out: Path, cap: int, deadline: float) -> Outcome:
    """One fresh process of ``side`` of ``task`` under ``cap``: preprocess reads raw parts in
    ``src`` and writes ``out/processed``; xgboost trains on the splits in ``src``."""
    from benchmarks.compute.preprocess_pandas import PLAIN
    from benchmarks.compute.preprocess_workers import PARAMS
    from benchmarks.compute.xgboost_dask import PLAIN as XGB_TRAIN

    out.mkdir(parents=True)
    outcome = Outcome(task, side, rows, out)
    if side == CLUSTER:
        args = side_command("benchmarks.compute.capped_cluster", task, str(cap), str(deadline), str(src), str(out))
    elif task == PREPROCESS:
        params = PARAMS[PREPROCESS]
        args = [sys.executable, str(PLAIN), str(src), str(out / "processed"), "--label", str(params["label"]),
                "--valid", str(params["valid_fraction"]), "--test", str(params["test_fraction"]),
                "--seed", str(PARAMS["seed"])]
    else:
        args = side_command("benchmarks.compute.xgboost_dask", XGB_TRAIN, str(src), str(out / "predictions.npy"))
    launch(outcome, args, cap, deadline, capped_all=side == SINGLE)
    if outcome.completed and task == PREPROCESS and side == SINGLE:
        check(outcome.report["forbidden"] == [], f"pandas: the plain script imported {outcome.report['forbidden']}")
    return outcome


# --- the benchmark --------------------------------------------------------------------------


@dataclass
class Measured:
    """Every outcome, per task, size and side, in the order taken."""

    cap: int
    outcomes: dict[tuple[str, int, str], list[Outcome]] = field(default_factory=dict)
    raw_mib: dict[int, float] = field(default_factory=dict)
    prepared_uncapped: list[int] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.setdefault((outcome.task, outcome.rows, outcome.side), []).append(outcome)

    def runs(self, task: str, rows: int, side: str) -> list[Outcome]:
        return self.outcomes.get((task, rows, side), [])

    def completed(self, task: str, rows: int, side: str) -> bool:
        """Completed in every repetition."""
        runs = self.runs(task, rows, side)
        return bool(runs) and all(o.completed for o in runs)

    def sizes(self, task: str) -> list[int]:
        return sorted({rows for t, rows, _ in self.outcomes if t == task})


def run(config: Config, log: Callable[[str], None]) -> Result:
    from benchmarks.compute.preprocess_pandas import Agreement, parts_for
    from benchmarks.compute.preprocess_workers import generate

    cap = QUICK_CAP if config.quick else FULL_CAP
    preprocess_sizes = QUICK_PREPROCESS if config.quick else FULL_PREPROCESS
    xgboost_sizes = QUICK_XGBOOST if config.quick else FULL_XGBOOST
    deadline = QUICK_DEADLINE_S if config.quick else FULL_DEADLINE_S
    repeats = config.reps(full=1, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-memory-cap-"))
    measured = Measured(cap)
    agreement = Agreement()
    counter = [0]

    def one(task: str, side: str, rows: int, src: Path) -> Outcome:
        counter[0] += 1
        outcome = measure(task, side, rows, src, scratch / f"run-{counter[0]:03d}-{task}-{side}", cap, deadline)
        measured.add(outcome)
        log(f"  {task} {rows_label(rows)} {outcome.name}: {outcome.verdict()}")
        return outcome

    try:
        for rows in sorted(set(preprocess_sizes) | set(xgboost_sizes)):
            raw = scratch / f"raw-{rows}"
            log(f"{NAME}: generating {rows:,} synthetic rows in {parts_for(rows)} parts (cap {_cap(cap)} per process)")
            generate(raw, rows, parts_for(rows))
            measured.raw_mib[rows] = sum(p.stat().st_size for p in raw.glob("*.parquet")) / MIB
            processed = _preprocess(one, measured, agreement, rows, raw, repeats) if rows in preprocess_sizes else None
            if rows in xgboost_sizes:
                if processed is None:
                    log(f"  {rows_label(rows)}: preparing the splits for xgboost on an uncapped cluster (not measured)")
                    prepared = measure(PREPROCESS, CLUSTER, rows, raw, scratch / f"prepared-{rows}", 64 * GIB,
                                       deadline)
                    check(prepared.completed, f"preparing {rows:,} rows for xgboost: {prepared.reason}")
                    measured.prepared_uncapped.append(rows)
                    processed = prepared.out / "processed"
                shutil.rmtree(raw)
                _xgboost(one, measured, rows, processed, repeats)
            for leftover in (raw, *scratch.glob("run-*"), *scratch.glob("prepared-*")):
                shutil.rmtree(leftover, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from benchmarks.compute.memory_cap_report import result

    return result(config, repeats, measured, agreement)


def _preprocess(one: Callable[[str, str, int, Path], Outcome], measured: Measured, agreement: Agreement, rows: int,
                raw: Path, repeats: int) -> Path | None:
    """Both sides of preprocess at ``rows``, ``repeats`` times, alternating; checks what they wrote.
    Where a completed Dask run wrote its splits (for xgboost), else None."""
    from benchmarks.compute.preprocess_pandas import compare, observe

    reference: list[Outputs] = []
    kept: Path | None = None
    for i in range(repeats):
        for side in (SINGLE, CLUSTER) if i % 2 == 0 else (CLUSTER, SINGLE):
            outcome = one(PREPROCESS, side, rows, raw)
            if outcome.completed:
                # pandas is the reference; a Dask run after a completed pandas run is compared with it
                outputs = observe(outcome.out / "processed", outcome.name, rows_in=rows,
                                  sort=side == SINGLE or bool(reference))
                if side == CLUSTER and reference:
                    compare(reference[0], outputs, outcome.name, agreement)
                elif side == SINGLE and reference:
                    check(outputs.digests == reference[0].digests and outputs.stats == reference[0].stats,
                          "pandas: this run wrote other rows or statistics than the first pandas run")
                elif side == SINGLE:
                    reference.append(outputs)
                if side == CLUSTER:
                    if kept is not None:
                        shutil.rmtree(kept.parent)
                    kept = outcome.out / "processed"
                    continue
            shutil.rmtree(outcome.out)
    return kept


def _xgboost(one: Callable[[str, str, int, Path], Outcome], measured: Measured, rows: int, processed: Path,
             repeats: int) -> None:
    """Both sides of xgboost on the splits in ``processed``, ``repeats`` times, alternating."""
    from benchmarks.compute.xgboost_dask import QUALITY

    for i in range(repeats):
        for side in (SINGLE, CLUSTER) if i % 2 == 0 else (CLUSTER, SINGLE):
            outcome = one(XGBOOST, side, rows, processed)
            shutil.rmtree(outcome.out)
            if outcome.completed:
                loss = float(outcome.report["best_logloss"])
                check(loss < LEARNED, f"xgboost {rows:,} rows, {outcome.name}: best valid logloss {loss:.4f}, not "
                                      f"below ln 2: it learned nothing")
    done = [o for side in (SINGLE, CLUSTER) for o in measured.runs(XGBOOST, rows, side) if o.completed]
    if {o.side for o in done} == {SINGLE, CLUSTER}:
        first = next(o for o in done if o.side == SINGLE).report["best_logloss"]
        for o in done:
            loss = o.report["best_logloss"]
            check(abs(loss - first) <= QUALITY * first, f"xgboost {rows:,} rows: {o.name}'s best valid logloss "
                                                        f"{loss:.6f} is more than {QUALITY:.0%} from xgb.train's "
                                                        f"{first:.6f}")
