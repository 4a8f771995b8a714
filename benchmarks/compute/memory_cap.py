"""memory-cap: from which data size one process no longer fits a per-process memory cap, and 2 Dask workers do.

A fresh process per side and size, preprocess (pandas vs ``prepare``) and xgboost (``xgb.train`` vs xgboost.dask);
a process above Dask's terminate share of the cap is killed, a Dask run completes only if no worker restarted.
Checked: runs end their process groups, pandas imports no dask, outputs as preprocess-pandas', xgboost learns alike.
"""

import contextlib
import io
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compute import preprocess_workers as pw
from benchmarks.compute.preprocess_pandas import parts_for, plain_command, see
from benchmarks.compute.xgboost_dask import LABEL, PLAIN, QUALITY, booster_params
from benchmarks.harness import REPO, Config, Metric, Result, check, rows_label, scratch, side_command, side_report
from benchmarks.processes import Sampler, stop_group
from benchmarks.projects import repo_env
from benchmarks.stages import current
from conveyor.train.xgb import train_xgboost

NAME = "memory-cap"
DESCRIPTION = ("under one memory cap per process: from which size one pandas/xgboost process no longer completes "
               "and a 2-worker Dask cluster does")
MIB, GIB = 2**20, 2**30
CAP, DEADLINE_S = {False: 5 * GIB // 4, True: 640 * MIB}, {False: 300.0, True: 120.0}  # by --quick
PREPROCESS, XGBOOST, SINGLE, CLUSTER = "preprocess", "xgboost", "single", "cluster"
SIDES, WORKERS = (SINGLE, CLUSTER), 2
SIZES = {False: {PREPROCESS: (1_000_000, 2_000_000, 4_000_000, 10_000_000), XGBOOST: (1_000_000, 2_000_000, 4_000_000)},
         True: {PREPROCESS: (250_000, 500_000, 1_000_000), XGBOOST: (250_000, 500_000)}}
SAMPLE_S = 0.05  # the sampler's period, and the nannies' (distributed.worker.memory.monitor-interval)
NAMES = {PREPROCESS: ("pandas", "Dask, 2 workers"), XGBOOST: ("xgb.train", "xgboost.dask, 2 workers")}  # by side
LOGGED = {"paused": "Pausing worker", "unmanaged memory high": "Unmanaged memory use is high",  # counted in stderr
          "restarted": "Restarting worker", "over the terminate threshold": "memory budget. Restarting"}


def _size(n: float) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:,.0f} MiB"


def _rows(sizes: list[int]) -> str:
    return ", ".join(f"{r:,}" for r in sizes) + " rows" if sizes else "no size"


@dataclass
class Outcome:  # one side at one size; peak RSS (bytes) of the process started (``root``), its largest descendant
    name: str
    side: str
    out: Path
    completed: bool = False
    reason: str = ""
    seconds: float = math.nan
    root: float = 0.0
    others: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    logged: str = ""  # the nannies' memory warnings, counted


VALUES: tuple[tuple[str, Callable[[Outcome], float], int], ...] = (
    ("wall of the work (s)", lambda o: o.seconds if o.completed else math.nan, 2),
    ("peak RSS of the largest process (MiB)", lambda o: max(o.root, o.others) / MIB if o.completed else math.nan, 0))


def measure(task: str, side: str, src: Path, out: Path, cap: int, deadline: float, share: float) -> Outcome:
    """``side`` in a fresh process group, killed when a capped process goes over ``share`` x ``cap``, or late."""
    out.mkdir(parents=True)
    o, started = Outcome(NAMES[task][SIDES.index(side)], side, out), time.perf_counter()
    args = (side_command(__name__, task, str(cap), str(src), str(out)) if side == CLUSTER else
            plain_command(src, out / "processed") if task == PREPROCESS else
            side_command("benchmarks.compute.xgboost_dask", PLAIN, str(src), str(out / "predictions.npy")))

    def watch(sizes: dict[int, int]) -> None:
        root = sizes.pop(proc.pid, 0)
        o.root, o.others = max(o.root, root), max([o.others, *sizes.values()])
        largest = max([root, *sizes.values()] if side == SINGLE else [root])
        if largest > share * cap and not o.reason:
            o.reason = (f"killed above the cap: a process at {_size(largest)} > {share:g} x {_size(cap)} after "
                        f"{time.perf_counter() - started:.1f} s")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    proc = subprocess.Popen(args, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)
    timeout = deadline + 60 * (side == SINGLE)
    with Sampler(proc.pid, SAMPLE_S, on_sample=watch):
        try:
            printed = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            o.reason = o.reason or f"killed: still running {timeout:.0f} s after it started"
            os.killpg(proc.pid, signal.SIGKILL)
            printed = proc.communicate()
    left = stop_group(proc.pid, grace_s=10)
    o.logged = ", ".join(f"{k} {n}x" for k, text in LOGGED.items() if (n := printed[1].count(text))) or "no warning"
    check(bool(o.reason) or not left, f"{o.name}: processes of its group were still running 10 s after it exited")
    if proc.returncode != 0 and not o.reason:
        o.reason = f"error: exit status {proc.returncode}: {(printed[1].strip().splitlines() or ['-'])[-1][:300]}"
    if not o.reason:
        o.report = side_report(printed[0], o.name)
        o.reason = str(o.report.get("reason", ""))
        o.completed, o.seconds = bool(o.report.get("completed", True)) and not o.reason, float(o.report["seconds"])
        check(not o.report.get("forbidden"), f"pandas: the plain script imported {o.report.get('forbidden')}")
    return o


def run(config: Config, log: Callable[[str], None]) -> Result:
    import dask
    import distributed  # noqa: F401 - registers distributed's configuration defaults
    share = float(dask.config.get("distributed.worker.memory.terminate"))  # of a worker's memory_limit
    cap, deadline, sizes, repeats = CAP[config.quick], DEADLINE_S[config.quick], SIZES[config.quick], config.reps(1, 1)
    outcomes, raw_mib, uncapped = dict[tuple[str, int, str], list[Outcome]](), dict[int, float](), list[int]()
    with scratch(NAME) as root:
        for rows in sorted({*sizes[PREPROCESS], *sizes[XGBOOST]}):
            raw, processed, ref = root / f"{rows}" / "raw", None, None
            pw.generate(raw, rows, parts_for(rows))
            raw_mib[rows] = sum(p.stat().st_size for p in raw.glob("*.parquet")) / MIB
            for task in (t for t in (PREPROCESS, XGBOOST) if rows in sizes[t]):
                if task == XGBOOST and processed is None:
                    o = measure(PREPROCESS, CLUSTER, raw, raw.parent / "prepared", 64 * GIB, deadline, share)
                    check(o.completed, f"preparing {rows:,} rows for xgboost: {o.reason}")
                    processed, uncapped = o.out / "processed", [*uncapped, rows]
                src = processed if task == XGBOOST and processed else raw
                for k in range(2 * repeats):  # S C, C S, ...
                    side = SIDES[(k + k // 2) % 2]
                    o = measure(task, side, src, raw.parent / f"{task}-{k}", cap, deadline, share)
                    outcomes.setdefault((task, rows, side), []).append(o)
                    log(f"  {task} {rows_label(rows)} {o.name}: {o.seconds:.1f} s of work {o.reason}")
                    if task == PREPROCESS and o.completed:  # pandas is the reference, the Dask side compared with it
                        ref = see(ref, o.out / "processed", o.name, rows, pandas=side == SINGLE)
                        processed = o.out / "processed" if side == CLUSTER else processed  # what xgboost trains on
                learned = [(o, o.report["best_logloss"]) for side in SIDES for o in outcomes[task, rows, side]
                           if o.completed and task == XGBOOST]
                first = next((loss for o, loss in learned if o.side == SINGLE), None)
                for o, loss in learned:
                    check(loss < math.log(2), f"xgboost {rows:,} rows, {o.name}: best valid logloss {loss:.4f}, "
                                              "not below ln 2: it learned nothing")
                    check(first is None or abs(loss - first) <= QUALITY * first, f"xgboost {rows:,} rows: {o.name}'s "
                          f"best valid logloss {loss:.6f} is more than {QUALITY:.0%} from xgb.train's {first}")
            shutil.rmtree(raw.parent)
    client = max(o.root for (_, _, side), runs in outcomes.items() if side == CLUSTER for o in runs)
    check(client < 0.8 * cap, f"the Dask side's client process reached {_size(client)}, {client / cap:.0%} of the cap")
    metrics, notes = list[Metric](), list[str]()
    for task in (PREPROCESS, XGBOOST):
        ran = sorted({rows for t, rows, _ in outcomes if t == task})
        done = {side: [r for r in ran if all(o.completed for o in outcomes[task, r, side])] for side in SIDES}
        failed = [r for r in ran if r not in done[SINGLE]]
        notes.append(f"{task}: {NAMES[task][0]} (one process) under {_size(cap)} per process completes at "
                     f"{_rows(done[SINGLE])}: " + (f"not from {failed[0]:,} rows on" if failed else "no crossover")
                     + f"; the 2-worker Dask cluster completes at {_rows(done[CLUSTER])}")
        for rows in ran:
            label, base, cand = f"{task} {rows_label(rows)} rows", *(outcomes[task, rows, side] for side in SIDES)
            metrics.append(Metric(f"{label}: completed under {_size(cap)} per process (1/0)",
                                  [o.completed for o in base], [o.completed for o in cand], "candidate/baseline", 0))
            metrics += [Metric(f"{label}: {what} where completed", [value(o) for o in base], [value(o) for o in cand],
                               digits=n) for what, value, n in VALUES if any(o.completed for o in base + cand)]
            for o in cand:  # what the docs quote: the largest worker, the nannies' warnings, what prepare said
                said = "".join(f"; prepare said: {m!r}" for m in o.report.get("messages", []) if m[:10] != "split rows")
                notes.append(f"{label}, {o.name}: " + (f"largest worker {_size(o.others)}; the workers logged "
                             f"{o.logged}{said}" if o.completed else f"did NOT complete: {o.reason}"))
    return Result(
        NAME, DESCRIPTION, "one process: pandas (`benchmarks/compute/plain_preprocess.py`) for preprocess; "
        "train_xgboost(None, ...) = xgb.train(nthread=2) for xgboost", f"a LocalCluster(n_workers={WORKERS}, "
        f"threads_per_worker=1, memory_limit={_size(cap)}): tasks.preprocess:prepare; train_xgboost(client, ...) = "
        "xgboost.dask", repeats, metrics, notes=notes,
        setup={"cap": f"{_size(cap)} per process, killed above {_size(share * cap)}; deadline {deadline:.0f} s",
               "data": ", ".join(f"{r:,} rows in {parts_for(r)} parts ({mib:.0f} MiB)" for r, mib in raw_mib.items()),
               "cores": str(os.cpu_count()), **({"xgboost's input, uncapped at": _rows(uncapped)} if uncapped else {})})


def side_main(argv: list[str]) -> int:
    """``preprocess|xgboost CAP_BYTES SRC OUT``: the task on 2 capped workers; JSON: seconds, completed, reason."""
    task, cap, src, out = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    check(task in (PREPROCESS, XGBOOST), f"memory_cap: unknown task {task!r}, expected {PREPROCESS} or {XGBOOST}")
    import dask
    import dask.dataframe as dd
    dask.config.set({"distributed.worker.memory.monitor-interval": f"{round(SAMPLE_S * 1000)}ms"})
    report, warned, nanny = dict[str, Any](task=task), io.StringIO(), logging.getLogger("distributed.nanny")
    (handler := logging.StreamHandler(warned)).setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        client = pw.start_cluster(WORKERS, stack, memory_limit=cap, silence_logs=logging.WARNING,
                                  local_directory=str(out / "dask"))
        client.run(pw.warm_imports if task == PREPROCESS else lambda: __import__("xgboost"))  # before the clock
        pids = set(client.run(os.getpid).values())
        nanny.addHandler(handler)
        if task == PREPROCESS:
            pw.prepare_timed(report, out, src, out / "processed", client, WORKERS)
        else:
            (params, rounds, patience), began = booster_params(None), time.perf_counter()
            train, valid = (dd.read_parquet(str(src / name)) for name in ("train", "valid"))
            with current(client):
                trained = train_xgboost(client, params, train, valid=valid, label=LABEL, num_boost_round=rounds,
                                        early_stopping_rounds=patience)
            report |= {"seconds": time.perf_counter() - began,
                       "best_logloss": float(trained.history["valid"]["logloss"][trained.best_iteration])}
        nanny.removeHandler(handler)
        replaced = sorted(set(client.run(os.getpid).values()) ^ pids)
    reasons = [f"a worker was restarted: {line}" for line in warned.getvalue().splitlines()]
    reasons += [f"worker processes replaced while it ran (pids {replaced})"] if replaced else []
    report |= {"completed": not reasons, "reason": "; ".join(reasons)}
    print(json.dumps(report), flush=True)
    return 0
