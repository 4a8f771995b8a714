"""memory-cap's result: per size, whether each side completed under the cap, and the sentences it is for
(from which size the single process stops fitting, how each side's largest process grew)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

from benchmarks.compute.memory_cap import (
    CLIENT_SHARE,
    CLUSTER,
    DESCRIPTION,
    FULL_DEADLINE_S,
    MARGIN,
    MIB,
    NAME,
    PREPROCESS,
    QUICK_DEADLINE_S,
    SAMPLE_S,
    SIDE_NAMES,
    SINGLE,
    WORKERS,
    XGBOOST,
    Measured,
    Outcome,
    _cap,
    _mib,
    fractions,
)
from benchmarks.compute.preprocess_pandas import Agreement
from benchmarks.harness import Config, Metric, Result, check, rows_label


def _values(runs: list[Outcome], what: Callable[[Outcome], float]) -> list[float]:
    """``what`` of each completed run, NaN for a run that did not complete."""
    return [what(o) if o.completed else math.nan for o in runs]


def result(config: Config, repeats: int, measured: Measured, agreement: Agreement) -> Result:
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
    limits = fractions()
    cluster_runs = [o for key, runs in measured.outcomes.items() if key[2] == CLUSTER for o in runs]
    client_peak = max(o.root for o in cluster_runs)
    check(client_peak < CLIENT_SHARE * cap, f"the Dask side's client process reached {_mib(client_peak)}, "
                                            f"{client_peak / cap:.0%} of the cap (at most {CLIENT_SHARE:.0%} allowed)")
    both = [rows for rows in measured.sizes(PREPROCESS) if measured.completed(PREPROCESS, rows, SINGLE)
            and measured.completed(PREPROCESS, rows, CLUSTER)]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="one process: pandas (`benchmarks/compute/plain_preprocess.py`) for preprocess; "
                 "train_xgboost(None, ...) = xgb.train(nthread=2) for xgboost",
        candidate=f"a LocalCluster(n_workers={WORKERS}, threads_per_worker=1, memory_limit={_cap(cap)}): "
                  "tasks.preprocess:prepare; train_xgboost(client, ...) = xgboost.dask",
        repeats=repeats, metrics=metrics,
        setup={"cap": f"{_cap(cap)} per process, on every process of both sides: killed above "
                      f"{limits['terminate']:g} x the cap = {_mib(limits['terminate'] * cap)}, checked every "
                      f"{SAMPLE_S * 1000:.0f} ms (the workers by their nanny, the rest by a psutil sampler)",
               "workers": f"spill from {limits['target']:g}/{limits['spill']:g} of the cap, pause at "
                          f"{limits['pause']:g} (Dask's defaults)",
               "data": ", ".join(f"{rows:,} rows in {parts_for(rows)} parts ({mib:.0f} MiB)"
                                 for rows, mib in sorted(measured.raw_mib.items())),
               "xgboost's input": "the splits the Dask preprocess wrote at that size"
                                  + (f" (an uncapped cluster's at {measured.prepared_uncapped} rows)"
                                     if measured.prepared_uncapped else "")
                                  + f"; params {json.dumps(booster_params(None))}",
               "deadline": f"{QUICK_DEADLINE_S if config.quick else FULL_DEADLINE_S:.0f} s per Dask run",
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
        notes=_notes(measured, limits),
    )


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
    threshold = fractions()["terminate"] * measured.cap
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
