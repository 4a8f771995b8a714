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
import json
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

from benchmarks.harness import REPO, Config, Metric, Result, check, rows_label, side_command, side_report

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
        outcome.reason += (f" (the workers paused {outcome.logged['paused']}x above {_fractions()['pause']:g} of the "
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
    return _result(config, repeats, measured, agreement)


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


# --- the report -----------------------------------------------------------------------------


def _values(runs: list[Outcome], what: Callable[[Outcome], float]) -> list[float]:
    """``what`` of each completed run, NaN for a run that did not complete."""
    return [what(o) if o.completed else math.nan for o in runs]


def _result(config: Config, repeats: int, measured: Measured, agreement: Agreement) -> Result:
    from benchmarks.compute.preprocess_pandas import parts_for
    from benchmarks.compute.xgboost_dask import QUALITY, booster_params

    cap = measured.cap
    metrics: list[Metric] = []
    for task in (PREPROCESS, XGBOOST):
        for rows in measured.sizes(task):
            base, cand = measured.runs(task, rows, SINGLE), measured.runs(task, rows, CLUSTER)
            label = f"{task} {rows_label(rows)} rows"
            metrics.append(Metric(f"{label}: completed under {_cap(cap)} per process (1/0)",
                                  [float(o.completed) for o in base], [float(o.completed) for o in cand],
                                  ratio="candidate/baseline", digits=0))
            if any(o.completed for o in (*base, *cand)):
                metrics += [Metric(f"{label}: wall of the work (s) where completed", _values(base, lambda o: o.seconds),
                                   _values(cand, lambda o: o.seconds)),
                            Metric(f"{label}: peak RSS of the largest process (MiB) where completed",
                                   _values(base, lambda o: o.largest / MIB), _values(cand, lambda o: o.largest / MIB),
                                   digits=0)]
    fractions = _fractions()
    cluster_runs = [o for key, runs in measured.outcomes.items() if key[2] == CLUSTER for o in runs]
    client_peak = max(o.root for o in cluster_runs)
    check(client_peak < CLIENT_SHARE * cap, f"the Dask side's client process reached {_mib(client_peak)}, "
                                            f"{client_peak / cap:.0%} of the cap (at most {CLIENT_SHARE:.0%} allowed)")
    both = [rows for rows in measured.sizes(PREPROCESS) if measured.completed(PREPROCESS, rows, SINGLE)
            and measured.completed(PREPROCESS, rows, CLUSTER)]
    data = ", ".join(f"{rows:,} rows in {parts_for(rows)} parts ({mib:.0f} MiB)"
                     for rows, mib in sorted(measured.raw_mib.items()))
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="one process: pandas (`benchmarks/compute/plain_preprocess.py`) for preprocess; "
                 "train_xgboost(None, ...) = xgb.train(nthread=2) for xgboost",
        candidate=f"a LocalCluster(n_workers={WORKERS}, threads_per_worker=1, memory_limit={_cap(cap)}): "
                  "tasks.preprocess:prepare; train_xgboost(client, ...) = xgboost.dask",
        repeats=repeats, metrics=metrics,
        setup={"cap": f"{_cap(cap)} per process, every process of both sides: a process whose RSS (VmRSS) exceeds "
                      f"{fractions['terminate']:g} x {_cap(cap)} = {_mib(fractions['terminate'] * cap)} is killed, "
                      f"checked every {SAMPLE_S * 1000:.0f} ms: the workers by their nanny (memory_limit, "
                      f"distributed.worker.memory.terminate {fractions['terminate']:g}, monitor-interval "
                      f"{SAMPLE_S * 1000:.0f}ms), the single process and the Dask side's client process by this "
                      "benchmark's sampler (psutil; its process group SIGKILLed); no RLIMIT_AS/RLIMIT_DATA",
               "workers": f"spill to disk from {fractions['target']:g}/{fractions['spill']:g} of the cap (managed/"
                          f"process memory), pause at {fractions['pause']:g}, restarted by the nanny above "
                          f"{fractions['terminate']:g} (Dask's defaults); a run during which a worker was restarted "
                          "or replaced is stopped at once and counts as not completed",
               "data": "synthetic HIGGS-shaped rows (conveyor.ingest.synthetic, seed 42; 28 float32 features, int64 "
                       f"label), one parquet part per 62,500 rows: {data}",
               "preprocess": "pandas: benchmarks/compute/plain_preprocess.py RAW OUT (label target, valid 0.15, test "
                             "0.2, seed 42); Dask: prepare(ctx) with the cluster as the current client, the task's "
                             "modules imported in the workers before the clock",
               "xgboost": "input: the splits the Dask preprocess wrote at that size (standardised float64, parts of "
                          "about 40,000 rows)"
                          + (f", prepared on an uncapped cluster at {measured.prepared_uncapped} rows"
                             if measured.prepared_uncapped else "")
                          + f"; params (booster, rounds, patience): {json.dumps(booster_params(None))}; xgb.train "
                          "with nthread 2 (benchmarks/compute/xgboost_dask.py's baseline side, unchanged)",
               "sizes": f"preprocess {', '.join(f'{r:,}' for r in measured.sizes(PREPROCESS))} rows; xgboost "
                        f"{', '.join(f'{r:,}' for r in measured.sizes(XGBOOST))} rows; ascending",
               "repetitions": f"{repeats} per size and side (whether a run completes does not depend on the load as "
                              "a timing does), no warm-up; each a fresh process; walls are indicative only (timings: "
                              "preprocess-pandas, xgboost-dask)",
               "deadline": f"{QUICK_DEADLINE_S if config.quick else FULL_DEADLINE_S:.0f} s per Dask run (a worker "
                           "paused for good would wait forever)",
               "memory": f"RSS of each process of the side's tree, sampled every {SAMPLE_S * 1000:.0f} ms; "
                         "'largest process' is the largest any one of them reached",
               "cores": str(os.cpu_count())},
        checks=["every run that did not complete was stopped and its whole process group ended; every completed run "
                "exited 0 and left no process of its group running",
                "the pandas side imported none of dask, distributed, conveyor, prefect",
                "every completed preprocess run split all its input rows (stats.json and the written parts agree)",
                (f"where both sides completed ({', '.join(f'{r:,}' for r in both)} rows), the Dask side wrote the "
                 f"pandas side's rows (sorted row-wise, within 1e-9 of a std; observed {agreement.rows:.2g}) and "
                 "stats.json (counts exactly; means and stds within 1e-9 of a std)") if both else
                "no size where both preprocess sides completed: no comparison of their outputs",
                f"every completed xgboost run learned (best valid logloss below ln 2); where both sides completed, "
                f"within {QUALITY:.0%} of each other",
                f"the Dask side's client process (client, scheduler, nannies) stayed below {CLIENT_SHARE:.0%} of the "
                f"cap: at most {_mib(client_peak)} ({client_peak / cap:.0%})"],
        notes=_notes(measured, fractions),
    )


def _fractions() -> dict[str, float]:
    import dask
    import distributed  # noqa: F401 - registers distributed's configuration defaults

    return {key: float(dask.config.get(f"distributed.worker.memory.{key}"))
            for key in ("target", "spill", "pause", "terminate")}


def _crossover(measured: Measured, task: str) -> str:
    """The sentence the benchmark is for: from which size the single process does not complete, and the cluster?"""
    sizes = measured.sizes(task)
    single, cap = SIDE_NAMES[task, SINGLE], _cap(measured.cap)
    failed = [rows for rows in sizes if not measured.completed(task, rows, SINGLE)]
    if not failed:
        return (f"{task}: {single} (one process) completes under {cap} per process at every size measured (up to "
                f"{sizes[-1]:,} rows): no crossover in this range")
    first = failed[0]
    later = [rows for rows in sizes if rows >= first]
    ok = [rows for rows in later if measured.completed(task, rows, CLUSTER)]
    text = f"{task}: from {first:,} rows on, {single} (one process) does not complete under {cap} per process"
    back = [rows for rows in later if measured.completed(task, rows, SINGLE)]
    if back:
        text += f" (though it did at {', '.join(f'{r:,}' for r in back)})"
    if ok == later:
        text += f"; the 2-worker Dask cluster does (at {', '.join(f'{r:,}' for r in ok)} rows)"
    elif not ok:
        text += "; the 2-worker Dask cluster does not either"
    else:
        text += (f"; the 2-worker Dask cluster does at {', '.join(f'{r:,}' for r in ok)} rows, not at "
                 f"{', '.join(f'{r:,}' for r in later if r not in ok)}")
    threshold = _fractions()["terminate"] * measured.cap
    close = [rows for rows in ok
             if max(o.largest for o in measured.runs(task, rows, CLUSTER)) > (1 - MARGIN) * threshold]
    if close:
        text += (f" (marginal at {', '.join(f'{r:,}' for r in close)} rows: within {MARGIN:.0%} of the kill threshold, "
                 "see below)")
    before = [rows for rows in sizes if rows < first and not measured.completed(task, rows, CLUSTER)]
    if before:
        text += f"; the cluster did not complete at {', '.join(f'{r:,}' for r in before)} rows either"
    return text


def _growth(measured: Measured, task: str) -> str:
    """How the largest process of each side grew with the rows, where it completed: why one side stops fitting."""

    parts = []
    for side in (SINGLE, CLUSTER):
        done = [(rows, max(o.others if side == CLUSTER else o.largest for o in measured.runs(task, rows, side)))
                for rows in measured.sizes(task) if measured.completed(task, rows, side)]
        who = "its largest worker" if side == CLUSTER else "the process"
        if len(done) >= 2:
            (r0, m0), (r1, m1) = done[0], done[-1]
            parts.append(f"{SIDE_NAMES[task, side]}: {who} {_mib(m0)} at {rows_label(r0)} rows, {_mib(m1)} at "
                         f"{rows_label(r1)} ({r1 / r0:g}x the rows, {m1 / m0:.2f}x the memory)")
        elif done:
            parts.append(f"{SIDE_NAMES[task, side]}: {who} {_mib(done[0][1])} at {rows_label(done[0][0])} rows "
                         "(the only size it completed)")
        else:
            parts.append(f"{SIDE_NAMES[task, side]}: completed at no size")
    how = {PREPROCESS: "a preprocess worker holds a few 62,500-row partitions at a time, whatever the rows; the "
                       "pandas process holds them all",
           XGBOOST: "an xgboost.dask worker holds its whole share of the training rows (train_xgboost pins one "
                    "partition of rows/2 to each worker) and builds its DMatrix from it, so its memory still grows "
                    "with the rows: 2 workers move the limit, they do not remove it"}[task]
    return f"{task}, largest process where completed: {'; '.join(parts)}. Why: {how}"


def _notes(measured: Measured, fractions: dict[str, float]) -> list[str]:

    notes = [_crossover(measured, PREPROCESS), _crossover(measured, XGBOOST), _growth(measured, PREPROCESS),
             _growth(measured, XGBOOST)]
    for (task, rows, _side), runs in sorted(measured.outcomes.items(), key=lambda kv: (kv[0][0] != PREPROCESS,
                                                                                      kv[0][1], kv[0][2] != SINGLE)):
        for o in runs:
            line = f"{task} {rows_label(rows)}, {o.name}: {o.verdict()}"
            if o.side == CLUSTER:
                said = [line for line in o.report.get("messages", []) if not line.startswith("split rows")]
                if said:
                    line += f"; prepare said: {'; '.join(repr(m) for m in said)}"
                logged = ", ".join(f"{what} {n}x" for what, n in o.logged.items() if n)
                line += (f"; largest worker {_mib(o.others)}, client process {_mib(o.root)}, the tree summed "
                         f"{_mib(o.tree)}; the workers logged {logged or 'no memory warning'}")
            elif o.completed:
                line += f" ({o.largest / measured.cap:.0%} of the cap)"
            threshold = fractions["terminate"] * measured.cap
            if o.completed and o.largest > (1 - MARGIN) * threshold:
                line += (f"; MARGINAL: its largest process came within {_mib(threshold - o.largest)} of the kill "
                         f"threshold ({_mib(threshold)}): another run at this size may not complete")
            notes.append(line)
    trees = [(o.tree, o) for runs in measured.outcomes.values() for o in runs if o.side == CLUSTER and o.completed]
    if trees:
        tree, biggest = max(trees, key=lambda t: t[0])
        notes.append(f"the cap bounds each process, not their sum: a completed Dask run's process tree held up to "
                     f"{_mib(tree)} summed ({biggest.task} {rows_label(biggest.rows)}: client {_mib(biggest.root)} and "
                     f"{WORKERS} workers), {tree / measured.cap:.1f}x the cap, where the single process stays below "
                     f"{fractions['terminate']:g}x the cap. So this is the case of a fixed memory per process (a "
                     "container, a small cluster node); given all of one machine's memory, one process fits what that "
                     "memory holds")
    notes.append("the completion rows' ratio is candidate/baseline: 1.00x both completed, nanx only the cluster "
                 "completed (1/0), 0.00x only the single process did; wall and peak are NaN for a side that did not "
                 "complete (a killed process's peak is the threshold it crossed, in the line above)")
    return notes
