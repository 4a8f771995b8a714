"""ingest-concurrency: ``tasks.ingest:fetch`` (conveyor.ingest) over HTTP with latency, 1 transfer at a time vs 8.

CSV sources behind ``LatencyServer`` (a process of its own, 100 ms a request): the ingest waits, so a pool of 8
(``ctx.executor``, as the ``threads`` profile gives it) should finish several times sooner than 1. Goal (issue 14,
item 4): ``fetch_sources`` of 64 sources at max_workers 16 within 1.25 x ceil(64/16) x 0.1 s plus start-up (the
wall of the same call on 1 source, interleaved, less the latency its requests waited). Every call is checked
against the server: one GET per source, the same requests every repetition, a part per source, the sources' rows.
"""

from __future__ import annotations

import io
import itertools
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.compute.latency_server import LatencyServer
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.stages import context, digest, read_parts

NAME = "ingest-concurrency"
DESCRIPTION = "ingest (files mode) of small CSV sources over HTTP with fixed latency per request"
COLUMNS, LATENCY_S, BASELINE_WORKERS, CANDIDATE_WORKERS = ["a", "b", "c", "d", "label"], 0.1, 1, 8
GOAL_SOURCES, GOAL_WORKERS, GOAL_EFFICIENCY, GOAL_ROWS = 64, 16, 0.8, 1000  # rows per source: ~47 KB
GOAL_IDEAL_S = math.ceil(GOAL_SOURCES / GOAL_WORKERS) * LATENCY_S
Call = tuple[float, int, float, float]  # wall, requests, first and last GET's arrival (s after the call began)


def csv_bytes(rows: int, seed: int) -> bytes:
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame(np.random.default_rng(seed).normal(size=(rows, len(COLUMNS))).round(6), columns=COLUMNS)
    return frame.to_csv(index=False).encode()


def fetch(server: LatencyServer, files: dict[str, bytes], out: Path, workers: int, task: bool, _i: int = 0) -> Call:
    """``tasks.ingest:fetch`` (``task``) or ``fetch_sources`` of ``files`` on a pool of ``workers``, checked."""
    import pandas as pd

    from conveyor.ingest import fetch_sources
    from tasks.ingest import fetch as fetch_task

    params = {"sources": [server.url(name) for name in files], "columns": COLUMNS, "skip_rows": 1, "mode": "files",
              "dtype": "float64", "retry": {"attempts": 3, "initial_delay_s": 0.05, "max_delay_s": 0.2},
              "timeout_s": 30}  # a retry is one more request: it fails the checks
    what, n = f"{len(files)} source(s) at max_workers={workers}", len(files)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"bench-ingest-{workers}") as pool:
        mark, started = len(server.arrivals()), time.perf_counter()
        if task:
            fetch_task(context("ingest", out, params={"ingest": params}, outs={"data/raw": out}, executor=pool,
                               n_workers=workers))
        else:
            done = fetch_sources(params, out, executor=pool)
        wall = time.perf_counter() - started
    arrived = server.arrivals()[mark:]
    gets = sorted(at - started for method, at in arrived if method == "GET")
    check(len(gets) == n, f"{what}: {len(gets)} GET of {len(arrived)} requests; expected one GET per source")
    if not task:
        check((done.retries, done.sources, done.parts, done.bytes) == (0, n, n, sum(map(len, files.values()))),
              f"{what}: reported {done}, expected no retry, {n} sources and parts, the bytes the server serves")
    parts = {int(m[1]) for p in out.glob("*") if (m := re.fullmatch(r"part-(\d{5})(-\d{4})?\.parquet", p.name))}
    check(parts == set(range(n)), f"{what}: no parquet part for source(s) {sorted(set(range(n)) - parts)}")
    want = pd.concat([pd.read_csv(io.BytesIO(body), skiprows=1, header=None, names=COLUMNS) for body in files.values()],
                     ignore_index=True).astype("float64")
    check(digest(read_parts(out)) == digest(want), f"{what}: the ingested rows differ from the sources' (or order)")
    shutil.rmtree(out)
    return wall, len(arrived), gets[0], gets[-1]


def run(config: Config, log: Callable[[str], None]) -> Result:
    sources, rows = (12, 1000) if config.quick else (24, 2000)
    repeats = config.reps(full=5, quick=3)
    files = {f"export-{i:03d}.csv": csv_bytes(rows, seed=i) for i in range(sources)}
    goal = {f"source-{i:03d}.csv": csv_bytes(GOAL_ROWS, seed=1000 + i) for i in range(GOAL_SOURCES)}
    root, counter = Path(tempfile.mkdtemp(prefix="conveyor-bench-ingest-")), itertools.count()
    try:
        with LatencyServer(files | goal, latency_s=LATENCY_S) as server:
            def call(files: dict[str, bytes], workers: int, task: bool) -> Callable[[int], Call]:
                return lambda _i: fetch(server, files, root / f"run-{next(counter)}", workers, task)

            log(f"{NAME}: warm-up (2 sources at each max_workers, {GOAL_SOURCES} at {GOAL_WORKERS}), then "
                f"{repeats} interleaved repetitions of max_workers 1 and 8, and of the goal's 1 and 64 sources")
            for workers, which in ((BASELINE_WORKERS, files), (CANDIDATE_WORKERS, files), (GOAL_WORKERS, goal)):
                call(dict(itertools.islice(which.items(), 2 if which is files else None)), workers, which is files)(0)
            base, cand = interleaved(repeats, call(files, BASELINE_WORKERS, True), call(files, CANDIDATE_WORKERS, True),
                                     log)
            one, many = interleaved(repeats, call(dict(itertools.islice(goal.items(), 1)), GOAL_WORKERS, False),
                                    call(goal, GOAL_WORKERS, False), log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for what, calls in (("the main runs", base + cand), ("1 source", one), (f"{GOAL_SOURCES} sources", many)):
        check(len({c[1] for c in calls}) == 1, f"{what}: the requests per call differ (a retry?): {calls}")
    startups, where = [c[0] - c[1] * LATENCY_S for c in one], f"{GOAL_SOURCES} sources @ max_workers {GOAL_WORKERS}"
    bound = Metric(f"goal, {where}: bound {1 / GOAL_EFFICIENCY:g} x ideal + start-up vs wall (s); ratio >= 1",
                   [GOAL_IDEAL_S / GOAL_EFFICIENCY + s for s in startups], [c[0] for c in many], digits=3)
    ideal = Metric(f"goal, {where}: ideal {GOAL_IDEAL_S:g} vs wall - start-up (s); ratio = efficiency >= "
                   f"{GOAL_EFFICIENCY:.2f}", [GOAL_IDEAL_S] * repeats,
                   [c[0] - s for c, s in zip(many, startups, strict=True)], digits=3)
    efficiency, kb = median(ideal.ratios()), [sum(map(len, f.values())) / len(f) / 1e3 for f in (files, goal)]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"conveyor.ingest fetch with a ThreadPoolExecutor(max_workers={BASELINE_WORKERS}) as ctx.executor; "
                 "in the goal rows, the goal's bound on the wall, and the ideal",
        candidate=f"the same with max_workers={CANDIDATE_WORKERS} (a threads profile's max_workers); in the goal rows, "
                  f"fetch_sources of {GOAL_SOURCES} sources at max_workers={GOAL_WORKERS}: wall, and wall - start-up",
        repeats=repeats, metrics=[Metric("wall time of fetch (s)", [c[0] for c in base], [c[0] for c in cand]),
                                  Metric("rows/s", [sources * rows / c[0] for c in base],
                                         [sources * rows / c[0] for c in cand], ratio="candidate/baseline", digits=0),
                                  bound, ideal],
        setup={"sources": f"{sources} CSV files of {rows} rows x {len(COLUMNS)} columns (~{kb[0]:.0f} KB each); "
                          f"the goal's {GOAL_SOURCES} of {GOAL_ROWS} rows (~{kb[1]:.0f} KB)",
               "requests per run": f"{base[0][1]}; the goal's start-up: the 1-source wall less {one[0][1]} x "
                                   f"{LATENCY_S:g} s of waiting"},
        checks=["every call made one GET per source, the same requests every repetition, wrote a part per source and "
                "the sources' rows (content hash, in order); fetch_sources reported no retry, the bytes served"],
        notes=[f"goal (issue 14, item 4): {where} with {LATENCY_S * 1e3:.0f} ms latency: wall <= "
               f"{1 / GOAL_EFFICIENCY:g} x {GOAL_IDEAL_S:g} s + start-up: {met(median(bound.ratios()) >= 1)}; "
               f"efficiency ideal / (wall - start-up) = {efficiency:.2f} (median; goal >= {GOAL_EFFICIENCY:.2f}): "
               f"{met(efficiency >= GOAL_EFFICIENCY)}; wall {median(bound.candidate):.3f} s, start-up "
               f"{median(startups):.3f} s; the first GET arrived at {median([c[2] for c in many]):.3f} s, the GETs "
               f"over {median([c[3] - c[2] for c in many]):.3f} s, and {median([c[0] - c[3] for c in many]):.3f} s "
               f"followed the last ({LATENCY_S:g} s its latency, the rest parsing and writing)"],
    )
