"""memory-cap: from which data size one process no longer fits a per-process memory cap, and 2 Dask workers do.

Under one cap ``C`` per process, each side a fresh process per size, ascending: preprocess (pandas,
``plain_preprocess.py``, vs ``tasks.preprocess:prepare``) and xgboost (``xgb.train(nthread=2)``, xgboost-dask's
baseline, vs ``train_xgboost(client, ...)`` on the splits the Dask preprocess wrote), the Dask side on a
``LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=C)`` in Dask's worker environment. Any process
above ``distributed.worker.memory.terminate`` x ``C`` is killed, checked every ``SAMPLE_S``: a worker by its
nanny, the rest by a psutil sampler (SIGKILL to the side's process group). A Dask run completes only if no
nanny warned (a worker restarted) and no worker was replaced while it ran, within the deadline. Completion
ratio: 1.00x both completed, nanx only the cluster, 0.00x only the single process (walls and peaks NaN).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import REPO, Config, Metric, Result, check, rows_label, side_command, side_report

if TYPE_CHECKING:
    from benchmarks.compute.preprocess_pandas import Agreement

NAME = "memory-cap"
DESCRIPTION = ("under one memory cap per process: from which size one pandas/xgboost process no longer completes "
               "and a 2-worker Dask cluster does")
MIB, GIB = 2**20, 2**30
CAP, DEADLINE_S = {False: 5 * GIB // 4, True: 640 * MIB}, {False: 300.0, True: 120.0}  # by --quick
PREPROCESS, XGBOOST, SINGLE, CLUSTER = "preprocess", "xgboost", "single", "cluster"
SIDES = (SINGLE, CLUSTER)
SIZES = {False: {PREPROCESS: (1_000_000, 2_000_000, 4_000_000, 10_000_000), XGBOOST: (1_000_000, 2_000_000, 4_000_000)},
         True: {PREPROCESS: (250_000, 500_000, 1_000_000), XGBOOST: (250_000, 500_000)}}
WORKERS = 2
SAMPLE_S = 0.05  # the sampler's period, and the nannies' (distributed.worker.memory.monitor-interval)
CLIENT_SHARE = 0.8  # the Dask side's client process must stay below this share of the cap (a worker pauses there)
MARGIN = 0.05  # a completed run whose largest process came this close to the kill threshold is flagged as marginal
SIDE_NAMES = {(PREPROCESS, SINGLE): "pandas", (PREPROCESS, CLUSTER): "Dask, 2 workers",
              (XGBOOST, SINGLE): "xgb.train", (XGBOOST, CLUSTER): "xgboost.dask, 2 workers"}
LOGGED = {"paused": "Pausing worker", "unmanaged memory high": "Unmanaged memory use is high",  # counted in stderr
          "restarted": "Restarting worker", "over the terminate threshold": "memory budget. Restarting"}


@functools.cache
def fractions() -> dict[str, float]:
    """Dask's ``distributed.worker.memory.*`` shares of a worker's ``memory_limit``."""
    import dask
    import distributed  # noqa: F401 - registers distributed's configuration defaults

    return {k: float(dask.config.get(f"distributed.worker.memory.{k}")) for k in ("target", "spill", "pause",
                                                                                   "terminate")}


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def _cap(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:g} MiB"


def _rows(sizes: list[int]) -> str:
    return ", ".join(f"{r:,}" for r in sizes) + " rows" if sizes else "no size"


@dataclass
class Outcome:
    """One side at one size. Peak RSS, bytes: ``root`` of the process started (the Dask side's client,
    scheduler and nannies), ``others`` of its largest descendant (a worker), ``tree`` of their sum."""

    task: str
    side: str
    rows: int
    out: Path
    completed: bool = False
    reason: str = ""
    wall: float = 0.0
    seconds: float = math.nan
    root: float = 0.0
    others: float = 0.0
    tree: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return SIDE_NAMES[self.task, self.side]

    @property
    def largest(self) -> float:
        return max(self.root, self.others)

    def work(self) -> float:
        return self.seconds if self.completed else math.nan

    def peak(self) -> float:
        return self.largest / MIB if self.completed else math.nan

    def verdict(self) -> str:
        return (f"completed ({self.seconds:.1f} s of work, {self.wall:.1f} s process; largest process "
                f"{_mib(self.largest)})" if self.completed else f"did NOT complete: {self.reason}")


def measure(task: str, side: str, rows: int, src: Path, out: Path, cap: int, deadline: float) -> Outcome:
    """One fresh process of ``side`` in a process group of its own, SIGKILLed when a capped process (single side:
    any; Dask side: the one started) goes over the terminate share of ``cap``, or at ``deadline`` (+ 60 s: single)."""
    from benchmarks.compute.preprocess_pandas import plain_command
    from benchmarks.compute.xgboost_dask import PLAIN
    from benchmarks.processes import Sampler, stop_group
    from benchmarks.projects import repo_env

    out.mkdir(parents=True)
    o = Outcome(task, side, rows, out)
    args = (side_command(__name__, task, str(cap), str(src), str(out)) if side == CLUSTER else
            plain_command(src, out / "processed") if task == PREPROCESS else
            side_command("benchmarks.compute.xgboost_dask", PLAIN, str(src), str(out / "predictions.npy")))
    limit, started = fractions()["terminate"] * cap, time.perf_counter()

    def watch(sizes: dict[int, int]) -> None:
        root = sizes.pop(proc.pid, 0)
        o.root, o.others = max(o.root, root), max([o.others, *sizes.values()])
        o.tree = max(o.tree, root + sum(sizes.values()))
        largest = max([root, *sizes.values()] if side == SINGLE else [root])
        if largest > limit and not o.reason:
            o.reason = (f"killed above the cap: a process at {_mib(largest)} > {fractions()['terminate']:g} x "
                        f"{_cap(cap)} after {time.perf_counter() - started:.1f} s")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    proc = subprocess.Popen(args, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)
    timeout = deadline + (0 if side == CLUSTER else 60)
    with Sampler(proc.pid, SAMPLE_S, on_sample=watch):
        try:
            printed = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            o.reason = o.reason or f"killed: still running {timeout:.0f} s after it started"
            os.killpg(proc.pid, signal.SIGKILL)
            printed = proc.communicate()
    o.wall, left = time.perf_counter() - started, stop_group(proc.pid, grace_s=10)
    o.logged = {what: printed[1].count(text) for what, text in LOGGED.items()}
    if o.reason:
        return o
    check(not left, f"{o.name}: processes of its group were still running 10 s after it exited (killed)")
    if proc.returncode != 0:
        o.reason = f"error: exit status {proc.returncode}: {(printed[1].strip().splitlines() or ['-'])[-1][:300]}"
        return o
    o.report = side_report(printed[0], o.name)
    o.reason = str(o.report.get("reason", ""))
    o.completed = bool(o.report.get("completed", True)) and not o.reason
    o.seconds = float(o.report["seconds"]) if o.completed else math.nan
    check(not o.report.get("forbidden"), f"pandas: the plain script imported {o.report.get('forbidden')}")
    return o


def run(config: Config, log: Callable[[str], None]) -> Result:
    from benchmarks.compute.preprocess_pandas import Agreement, parts_for
    from benchmarks.compute.preprocess_workers import generate
    from benchmarks.compute.xgboost_dask import QUALITY

    cap, deadline, sizes = CAP[config.quick], DEADLINE_S[config.quick], SIZES[config.quick]
    repeats = config.reps(full=1, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-memory-cap-"))
    outcomes: dict[tuple[str, int, str], list[Outcome]] = {}
    raw_mib: dict[int, float] = {}
    uncapped: list[int] = []
    both: set[int] = set()
    agreement = Agreement()

    def sides(task: str, rows: int, src: Path) -> Iterator[Outcome]:
        """Both sides of ``task`` at ``rows``, ``repeats`` times, alternating (S C, C S, ...)."""
        for i in range(repeats):
            for side in SIDES[::1 - 2 * (i % 2)]:
                o = measure(task, side, rows, src, scratch / f"run-{rows}-{i}-{task}-{side}", cap, deadline)
                outcomes.setdefault((task, rows, side), []).append(o)
                log(f"  {task} {rows_label(rows)} {o.name}: {o.verdict()}")
                yield o

    try:
        for rows in sorted({*sizes[PREPROCESS], *sizes[XGBOOST]}):
            raw, processed, agreement.reference = scratch / f"raw-{rows}", None, None
            log(f"{NAME}: generating {rows:,} synthetic rows in {parts_for(rows)} parts (cap {_cap(cap)} per process)")
            generate(raw, rows, parts_for(rows))
            raw_mib[rows] = sum(p.stat().st_size for p in raw.glob("*.parquet")) / MIB
            for o in sides(PREPROCESS, rows, raw) if rows in sizes[PREPROCESS] else ():
                if o.completed:  # pandas is the reference; a Dask run after a completed pandas run is compared with it
                    agreement.see(o.out / "processed", o.name, rows, pandas=o.side == SINGLE)
                if o.completed and o.side == CLUSTER:
                    processed = o.out / "processed"  # the splits xgboost trains on
                    both |= {rows} if agreement.reference else set()
                else:
                    shutil.rmtree(o.out)
            if rows in sizes[XGBOOST]:
                if processed is None:
                    log(f"  {rows_label(rows)}: preparing the splits for xgboost on an uncapped cluster (not measured)")
                    prepared = measure(PREPROCESS, CLUSTER, rows, raw, scratch / f"prepared-{rows}", 64 * GIB, deadline)
                    check(prepared.completed, f"preparing {rows:,} rows for xgboost: {prepared.reason}")
                    processed, uncapped = prepared.out / "processed", [*uncapped, rows]
                shutil.rmtree(raw)
                done = [o for o in sides(XGBOOST, rows, processed) if o.completed]
                first = next((o.report["best_logloss"] for o in done if o.side == SINGLE), None)
                for o in done:
                    loss = o.report["best_logloss"]
                    check(loss < math.log(2), f"xgboost {rows:,} rows, {o.name}: best valid logloss {loss:.4f}, "
                                              "not below ln 2: it learned nothing")
                    check(first is None or abs(loss - first) <= QUALITY * first, f"xgboost {rows:,} rows: {o.name}'s "
                          f"best valid logloss {loss:.6f} is more than {QUALITY:.0%} from xgb.train's {first}")
            for leftover in (raw, *scratch.glob("run-*"), *scratch.glob("prepared-*")):
                shutil.rmtree(leftover, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(config, repeats, cap, outcomes, raw_mib, uncapped, agreement, sorted(both))


def _result(config: Config, repeats: int, cap: int, outcomes: dict[tuple[str, int, str], list[Outcome]],
            raw_mib: dict[int, float], uncapped: list[int], agreement: Agreement, both: list[int]) -> Result:
    from benchmarks.compute.preprocess_pandas import TOLERANCE, parts_for
    from benchmarks.compute.xgboost_dask import QUALITY, booster_params

    metrics: list[Metric] = []
    limits, notes = fractions(), []
    limit = limits["terminate"] * cap
    for task in (PREPROCESS, XGBOOST):
        sizes = sorted({rows for t, rows, _ in outcomes if t == task})
        for rows in sizes:
            label, base, cand = f"{task} {rows_label(rows)} rows", *(outcomes[task, rows, side] for side in SIDES)
            metrics.append(Metric(f"{label}: completed under {_cap(cap)} per process (1/0)",
                                  [o.completed for o in base], [o.completed for o in cand], "candidate/baseline", 0))
            for what, value, digits in (("wall of the work (s)", Outcome.work, 2),
                                        ("peak RSS of the largest process (MiB)", Outcome.peak, 0)):
                if any(o.completed for o in (*base, *cand)):
                    metrics.append(Metric(f"{label}: {what} where completed", [value(o) for o in base],
                                          [value(o) for o in cand], digits=digits))
        done = {side: [r for r in sizes if all(o.completed for o in outcomes[task, r, side])] for side in SIDES}
        close = [r for r in done[CLUSTER] if max(o.largest for o in outcomes[task, r, CLUSTER]) > (1 - MARGIN) * limit]
        failed = [r for r in sizes if r not in done[SINGLE]]
        notes.append(f"{task}: {SIDE_NAMES[task, SINGLE]} (one process) under {_cap(cap)} per process completes at "
                     f"{_rows(done[SINGLE])}: " + (f"not from {failed[0]:,} rows on" if failed else "no crossover")
                     + f"; the 2-worker Dask cluster completes at {_rows(done[CLUSTER])}"
                     + (f" (marginal at {_rows(close)}: within {MARGIN:.0%} of the kill threshold)" if close else ""))
    for (task, rows, side), runs in sorted(outcomes.items(), key=lambda kv: (kv[0][0] != PREPROCESS, kv[0][1],
                                                                             kv[0][2] != SINGLE)):
        for o in runs:
            said = "; ".join(repr(m) for m in o.report.get("messages", []) if not m.startswith("split rows"))
            logged = ", ".join(f"{what} {n}x" for what, n in o.logged.items() if n) or "no memory warning"
            notes.append(f"{task} {rows_label(rows)}, {o.name}: {o.verdict()}" + (
                f"; largest worker {_mib(o.others)}, client process {_mib(o.root)}, the tree summed {_mib(o.tree)} "
                f"({o.tree / cap:.1f}x the cap); the workers logged {logged}" + (said and f"; prepare said: {said}")
                if side == CLUSTER else f" ({o.largest / cap:.0%} of the cap)" if o.completed else ""))
    client = max(o.root for (_, _, side), runs in outcomes.items() if side == CLUSTER for o in runs)
    check(client < CLIENT_SHARE * cap, f"the Dask side's client process reached {_mib(client)}, {client / cap:.0%} "
                                       f"of the cap (at most {CLIENT_SHARE:.0%} allowed)")
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="one process: pandas (`benchmarks/compute/plain_preprocess.py`) for preprocess; "
                 "train_xgboost(None, ...) = xgb.train(nthread=2) for xgboost",
        candidate=f"a LocalCluster(n_workers={WORKERS}, threads_per_worker=1, memory_limit={_cap(cap)}): "
                  "tasks.preprocess:prepare; train_xgboost(client, ...) = xgboost.dask",
        repeats=repeats, metrics=metrics,
        setup={"cap": f"{_cap(cap)} per process: killed above {limits['terminate']:g} x the cap = {_mib(limit)}, "
                      f"checked every {SAMPLE_S * 1000:.0f} ms; workers spill from {limits['target']:g}/"
                      f"{limits['spill']:g} of it, pause at {limits['pause']:g} (Dask's defaults)",
               "data": ", ".join(f"{r:,} rows in {parts_for(r)} parts ({mib:.0f} MiB)" for r, mib in raw_mib.items()),
               "xgboost's input": "the splits the Dask preprocess wrote at that size" + (
                   f" (an uncapped cluster's at {_rows(uncapped)})" if uncapped else "")
                   + f"; params {json.dumps(booster_params(None))}",
               "deadline": f"{DEADLINE_S[config.quick]:.0f} s per Dask run (+ 60 s: one process)",
               "cores": str(os.cpu_count())},
        checks=["a run that did not complete was stopped, its whole process group ended; a completed run exited 0 "
                "and left no process of its group running; the pandas side imported none of dask, conveyor, prefect",
                "every completed preprocess run split all its input rows (stats.json and the written parts agree)",
                f"where both sides completed ({_rows(both)}), the Dask side wrote pandas' rows (sorted row-wise, "
                f"within {TOLERANCE:g} of a std; observed {agreement.rows:.2g}) and stats.json" if both else
                "no size where both preprocess sides completed: no comparison of their outputs",
                f"every completed xgboost run learned (best valid logloss below ln 2), within {QUALITY:.0%} of "
                f"xgb.train's where both completed; the Dask side's client process stayed below {CLIENT_SHARE:.0%} "
                f"of the cap (at most {_mib(client)})"],
        notes=notes,
    )


def side_main(argv: list[str]) -> int:
    """``preprocess|xgboost CAP_BYTES SRC OUT``: the task once on a 2-worker LocalCluster, ``memory_limit=CAP_BYTES``
    (spilling to ``OUT/dask``); one JSON line: ``seconds`` of the work, ``reason`` (what the nannies warned of
    while it ran, workers replaced), ``completed`` without one."""
    task, cap, src, out = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    check(task in (PREPROCESS, XGBOOST), f"memory_cap: unknown task {task!r}, expected {PREPROCESS} or {XGBOOST}")
    import dask

    from benchmarks.compute.preprocess_workers import prepare_timed, start_cluster, warm_imports

    dask.config.set({"distributed.worker.memory.monitor-interval": f"{round(SAMPLE_S * 1000)}ms"})
    report: dict[str, Any] = {"task": task}
    warned, nanny = io.StringIO(), logging.getLogger("distributed.nanny")
    handler = logging.StreamHandler(warned)
    handler.setLevel(logging.WARNING)
    with ExitStack() as stack:
        client = start_cluster(WORKERS, stack, memory_limit=cap, silence_logs=logging.WARNING,
                               local_directory=str(out / "dask"))
        client.run(warm_imports if task == PREPROCESS else lambda: __import__("xgboost"))  # before the clock
        pids = set(client.run(os.getpid).values())
        nanny.addHandler(handler)
        if task == PREPROCESS:
            prepare_timed(report, out, src, out / "processed", client, WORKERS)
        else:
            report |= _train(client, src)
        nanny.removeHandler(handler)
        replaced = sorted(set(client.run(os.getpid).values()) ^ pids)
    reasons = [f"a worker was restarted: {line}" for line in warned.getvalue().splitlines()]
    reasons += [f"worker processes replaced while it ran (pids {replaced})"] if replaced else []
    report |= {"completed": not reasons, "reason": "; ".join(reasons)}
    print(json.dumps(report), flush=True)
    return 0


def _train(client: Any, src: Path) -> dict[str, Any]:
    """``train_xgboost`` on the cluster, on the splits in ``src``, with the reference project's ``train.xgb``."""
    import dask.dataframe as dd

    from benchmarks.compute.xgboost_dask import LABEL, booster_params
    from benchmarks.stages import current
    from conveyor.train.xgb import train_xgboost

    params, rounds, patience = booster_params(None)
    split = {name: dd.read_parquet(str(src / name)) for name in ("train", "valid")}
    began = time.perf_counter()
    with current(client):
        trained = train_xgboost(client, params, split["train"], valid=split["valid"], label=LABEL, features=[
            c for c in split["train"].columns if c != LABEL], num_boost_round=rounds, early_stopping_rounds=patience)
    return {"seconds": time.perf_counter() - began, "rounds": trained.rounds, "best_iteration": trained.best_iteration,
            "best_logloss": float(trained.history["valid"]["logloss"][trained.best_iteration])}
