"""ingest-concurrency: ``tasks.ingest:fetch`` (conveyor.ingest) over HTTP with latency, 1 transfer at a time vs 8.

Many small CSV sources behind a server that answers each request 100 ms late: the
ingest is waiting, not computing, so a thread pool of 8 should finish several times
sooner than one of 1. The task is called directly with a StageContext whose executor is
the pool (as the ``threads`` profile gives it); each run writes a fresh ``data/raw``.

Then the goal of issue 14, item 4: "ingest at >= 0.8 of ideal: 64 sources with 100 ms
latency at ``max_workers`` 16: wall <= 1.25 x ceil(64/16) x 0.1 s plus start-up".
``conveyor.ingest.fetch_sources`` on a ThreadPoolExecutor(max_workers=16) fetches 64
sources, interleaved with the same call on 1 source, whose wall less the latency its
requests waited (one after the other) is the start-up. Efficiency = ideal / (wall - start-up),
per repetition. The server notes when each request arrives, which tells where the wall
goes: listing (a HEAD per source), transfers (a GET per source), and what follows the last
response. ``python -m benchmarks.compute.ingest_concurrency [--quick]`` runs this part alone (table
and notes to stdout, no result file).
"""

from __future__ import annotations

import io
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compute.latency_server import LatencyServer
from benchmarks.harness import Config, Metric, Result, check, interleaved, met, table, timed
from benchmarks.stages import context, digest, read_parts

NAME = "ingest-concurrency"
DESCRIPTION = "ingest (files mode) of small CSV sources over HTTP with fixed latency per request"
COLUMNS = ["a", "b", "c", "d", "label"]
LATENCY_S = 0.1
BASELINE_WORKERS = 1
CANDIDATE_WORKERS = 8
WARM_UP_SOURCES = 2
# The goal (issue 14, item 4): GOAL_SOURCES sources at max_workers GOAL_WORKERS, wall - start-up
# within 1 / GOAL_EFFICIENCY (1.25) x the ideal ceil(GOAL_SOURCES / GOAL_WORKERS) x LATENCY_S.
GOAL_SOURCES = 64
GOAL_WORKERS = 16
GOAL_EFFICIENCY = 0.8
GOAL_ROWS = 1000  # rows per source (~47 KB): small, so the measurement is about waiting
GOAL_ROUNDS = math.ceil(GOAL_SOURCES / GOAL_WORKERS)
GOAL_IDEAL_S = GOAL_ROUNDS * LATENCY_S


def csv_bytes(rows: int, seed: int) -> bytes:
    """A CSV file: a header line and ``rows`` rows of floats."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.normal(size=(rows, len(COLUMNS))).round(6), columns=COLUMNS)
    return frame.to_csv(index=False).encode()


def ingest_params(urls: list[str]) -> dict[str, Any]:
    """``ingest`` params for the URLs: files mode, header skipped; a retry would distort the
    timing, so one shows up as extra requests and fails the request-count check."""
    return {"sources": urls, "columns": COLUMNS, "skip_rows": 1, "dtype": "float64", "mode": "files",
            "retry": {"attempts": 3, "initial_delay_s": 0.05, "max_delay_s": 0.2}, "timeout_s": 30}


@dataclass(frozen=True)
class Call:
    """One ``fetch_sources`` call: its wall, and its requests as the server saw them (times in s
    after the call began, when each request reached the server, before its latency)."""

    wall_s: float
    heads: int
    gets: int
    last_head_s: float  # 0 without a HEAD
    first_get_s: float
    last_get_s: float

    @property
    def requests(self) -> int:
        return self.heads + self.gets


@dataclass(frozen=True)
class Goal:
    """The goal's repetitions: ``one`` the 1-source calls, ``many`` the GOAL_SOURCES-source ones, paired."""

    kb_per_source: float
    one: list[Call]
    many: list[Call]

    def walls(self) -> list[float]:
        return [call.wall_s for call in self.many]

    def startups(self, waits: int | None = None) -> list[float]:
        """Per repetition: the 1-source wall less the latency its requests waited, one after the
        other (``waits`` of them; None: every request the call made)."""
        return [call.wall_s - (call.requests if waits is None else waits) * LATENCY_S for call in self.one]

    def efficiencies(self, waits: int | None = None) -> list[float]:
        """Per repetition: ideal / (wall - start-up)."""
        return [GOAL_IDEAL_S / (wall - startup) for wall, startup in zip(self.walls(), self.startups(waits),
                                                                          strict=True)]

    def bounds(self, waits: int | None = None) -> list[float]:
        """Per repetition: the goal's bound on the wall, 1.25 x ideal + start-up."""
        return [GOAL_IDEAL_S / GOAL_EFFICIENCY + startup for startup in self.startups(waits)]


def measure_goal(config: Config, log: Callable[[str], None]) -> Goal:
    """``conveyor.ingest.fetch_sources`` of GOAL_SOURCES sources on a pool of GOAL_WORKERS, interleaved
    with the same call on 1 source; every call checked against what the server served."""
    import pandas as pd

    from conveyor.ingest import fetch_sources

    repeats = config.reps(full=5, quick=3)
    files = {f"source-{i:03d}.csv": csv_bytes(GOAL_ROWS, seed=1000 + i) for i in range(GOAL_SOURCES)}
    names = sorted(files)
    frames = [pd.read_csv(io.BytesIO(files[name]), skiprows=1, header=None, names=COLUMNS).astype("float64")
              for name in names]
    expected = {n: (sum(map(len, frames[:n])), digest(pd.concat(frames[:n], ignore_index=True)),
                    sum(len(files[name]) for name in names[:n])) for n in (1, GOAL_SOURCES)}
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-ingest-goal-"))
    server = LatencyServer(files, latency_s=LATENCY_S)
    runs = [0]
    try:
        with server:
            urls = [server.url(name) for name in names]

            def fetch(n: int) -> Call:
                runs[0] += 1
                out = root / f"run-{runs[0]:03d}" / "raw"
                with ThreadPoolExecutor(max_workers=GOAL_WORKERS, thread_name_prefix="bench-ingest-goal") as pool:
                    mark = server.served()
                    started = time.perf_counter()
                    done = fetch_sources(ingest_params(urls[:n]), out, executor=pool)
                    wall = time.perf_counter() - started
                arrived = server.arrivals()[mark:]
                heads = sorted(at - started for method, at in arrived if method == "HEAD")
                gets = sorted(at - started for method, at in arrived if method == "GET")
                rows, want, size = expected[n]
                what = f"{n} source(s) at max_workers={GOAL_WORKERS}"
                check(len(gets) == n and done.retries == 0 and len(heads) + len(gets) == len(arrived),
                      f"{what}: {len(gets)} GET, {len(heads)} HEAD, {len(arrived)} requests in all and "
                      f"{done.retries} retries; expected one GET per source and no retry")
                check(done.sources == n and done.parts == n, f"{what}: {done.sources} sources in {done.parts} "
                                                             f"parts reported, expected {n} in {n}")
                check(done.bytes == size, f"{what}: {done.bytes} bytes arrived, the server serves {size}")
                written = {int(m[1]) for part in out.glob("part-*.parquet")
                           if (m := re.fullmatch(r"part-(\d{5})(-\d{4})?\.parquet", part.name))}
                check(written == set(range(n)), f"{what}: no parquet part for source(s) "
                                                f"{sorted(set(range(n)) - written)}")
                frame = read_parts(out)
                check(len(frame) == rows == done.rows, f"{what}: {len(frame)} rows in the parts, {done.rows} "
                                                       f"reported, the sources hold {rows}")
                check(digest(frame) == want, f"{what}: the ingested rows differ from the sources' (content or "
                                             "order)")
                shutil.rmtree(out.parent)
                return Call(wall, len(heads), len(gets), max(heads, default=0.0), gets[0], gets[-1])

            log(f"{NAME}: goal: warm-up (one run of {GOAL_SOURCES} sources at max_workers={GOAL_WORKERS}, "
                "not counted)")
            fetch(GOAL_SOURCES)
            log(f"{NAME}: goal: {repeats} interleaved repetitions, 1 source and {GOAL_SOURCES} sources")
            one, many = interleaved(repeats, lambda _i: fetch(1), lambda _i: fetch(GOAL_SOURCES), log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for calls, n in ((one, 1), (many, GOAL_SOURCES)):
        pattern = {(call.heads, call.gets) for call in calls}
        check(len(pattern) == 1, f"{n} source(s): the requests per call differ between repetitions: {pattern}")
    return Goal(sum(map(len, files.values())) / GOAL_SOURCES / 1e3, one, many)


def goal_metrics(goal: Goal) -> list[Metric]:
    """Two rows whose ratio column is the verdict: the wall against the goal's bound (>= 1: met), and
    the efficiency ideal / (wall - start-up) (>= GOAL_EFFICIENCY: met)."""
    startups = goal.startups()
    where = f"{GOAL_SOURCES} sources @ max_workers {GOAL_WORKERS}"
    return [
        Metric(f"goal, {where}: bound {1 / GOAL_EFFICIENCY:g} x ideal + start-up vs wall (s); ratio >= 1",
               goal.bounds(), goal.walls(), digits=3),
        Metric(f"goal, {where}: ideal {GOAL_IDEAL_S:g} vs wall - start-up (s); ratio = efficiency >= "
               f"{GOAL_EFFICIENCY:.2f}", [GOAL_IDEAL_S] * len(startups),
               [wall - startup for wall, startup in zip(goal.walls(), startups, strict=True)], digits=3),
    ]


def goal_setup(goal: Goal) -> dict[str, str]:
    return {"goal sources": f"{GOAL_SOURCES} CSV files of {GOAL_ROWS} rows (~{goal.kb_per_source:.0f} KB each)",
            "goal start-up": f"the 1-source wall less {goal.one[0].requests} x {LATENCY_S:g} s of waiting"}


def goal_checks() -> list[str]:
    return [f"goal: every call of 1 and of {GOAL_SOURCES} sources fetched each source once (one GET, no retry), "
            "reported and wrote every source's part and bytes, with the sources' rows (count and content hash); "
            "every repetition made the same requests"]


def goal_notes(goal: Goal) -> list[str]:
    med = statistics.median
    wall, startup, efficiency = med(goal.walls()), med(goal.startups()), med(goal.efficiencies())
    held = med(b / w for b, w in zip(goal.bounds(), goal.walls(), strict=True)) >= 1
    many = goal.many[0]
    to_first_get = med(c.first_get_s for c in goal.many)
    gets_span = med(c.last_get_s - c.first_get_s for c in goal.many)
    after = med(c.wall_s - c.last_get_s for c in goal.many)
    return [
        f"goal (issue 14, item 4): {GOAL_SOURCES} sources with {LATENCY_S * 1e3:.0f} ms latency at max_workers "
        f"{GOAL_WORKERS}: wall <= {1 / GOAL_EFFICIENCY:g} x {GOAL_IDEAL_S:g} s + start-up: {met(held)}; efficiency "
        f"ideal / (wall - start-up) = {efficiency:.2f} (median; goal >= {GOAL_EFFICIENCY:.2f}): "
        f"{met(efficiency >= GOAL_EFFICIENCY)}; wall {wall:.3f} s, start-up {startup:.3f} s",
        f"goal, where the {wall:.3f} s go (medians, as the server saw the requests; {many.heads} HEAD, {many.gets} "
        f"GET): the first GET arrived at {to_first_get:.3f} s, the GETs over {gets_span:.3f} s, and {after:.3f} s "
        f"followed the last ({LATENCY_S:g} s its latency, the rest parsing and writing the last sources)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.compute.ingest_concurrency [--quick]``: the goal measurement alone; table and
    notes to stdout, no result file."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg != "--quick" for arg in args):
        print("usage: python -m benchmarks.compute.ingest_concurrency [--quick]", file=sys.stderr)
        return 2
    goal = measure_goal(Config(quick="--quick" in args), lambda line: print(line, file=sys.stderr, flush=True))
    result = Result(name=f"{NAME} (goal)", description=DESCRIPTION, baseline="", candidate="",
                    repeats=len(goal.many), metrics=goal_metrics(goal))
    print(table(result))
    print("\n".join(["setup:", *(f"  {k}: {v}" for k, v in goal_setup(goal).items()), "notes:",
                     *(f"  - {line}" for line in goal_notes(goal))]))
    return 0


def run(config: Config, log: Callable[[str], None]) -> Result:
    import pandas as pd

    from tasks.ingest import fetch as ingest_fetch

    sources, rows_per_source = (12, 1000) if config.quick else (24, 2000)
    repeats = config.reps(full=5, quick=3)
    files = {f"export-{i:03d}.csv": csv_bytes(rows_per_source, seed=i) for i in range(sources)}
    expected = pd.concat([pd.read_csv(io.BytesIO(body), skiprows=1, header=None, names=COLUMNS)
                          for _, body in sorted(files.items())], ignore_index=True).astype("float64")
    expected_digest = digest(expected)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-ingest-"))
    wall = Metric("wall time of fetch (s)")
    rate = Metric("rows/s", ratio="candidate/baseline", digits=0)
    requests: dict[int, set[int]] = {BASELINE_WORKERS: set(), CANDIDATE_WORKERS: set()}
    runs = [0]
    try:
        with LatencyServer(files, latency_s=LATENCY_S) as server:
            urls = [server.url(name) for name in sorted(files)]
            params = {"ingest": ingest_params(urls)}

            def fetch(workers: int) -> float:
                runs[0] += 1
                out = root / f"run-{runs[0]:03d}" / "data" / "raw"
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"bench-ingest-{workers}") as pool:
                    ctx = context("ingest", root, params=params, outs={"data/raw": out}, executor=pool,
                                  n_workers=workers)
                    before = server.served()
                    seconds, _ = timed(lambda: ingest_fetch(ctx))
                    served = server.served() - before
                frame = read_parts(out)
                check(len(frame) == len(expected), f"max_workers={workers}: {len(frame)} rows ingested, "
                                                   f"expected {len(expected)}")
                check(digest(frame) == expected_digest, f"max_workers={workers}: the ingested rows differ from "
                                                        "the sources' (content or order)")
                requests[workers].add(served)
                shutil.rmtree(out.parent.parent)
                return seconds

            log(f"{NAME}: warm-up (one run each of {WARM_UP_SOURCES} sources, not counted)")
            for workers in (BASELINE_WORKERS, CANDIDATE_WORKERS):
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    warm = root / f"warm-up-{workers}" / "data" / "raw"
                    ingest_fetch(context("ingest", root, params={"ingest": ingest_params(urls[:WARM_UP_SOURCES])},
                                         outs={"data/raw": warm}, executor=pool, n_workers=workers))
                check(len(read_parts(warm)) == WARM_UP_SOURCES * rows_per_source, "warm-up: rows missing")
            log(f"{NAME}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, lambda _i: fetch(BASELINE_WORKERS), lambda _i: fetch(CANDIDATE_WORKERS),
                                     log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall.baseline, wall.candidate = base, cand
    rate.baseline = [len(expected) / s for s in base]
    rate.candidate = [len(expected) / s for s in cand]
    check(len(requests[BASELINE_WORKERS] | requests[CANDIDATE_WORKERS]) == 1,
          f"requests per run differ (a retry?): max_workers=1 {sorted(requests[BASELINE_WORKERS])}, "
          f"max_workers=8 {sorted(requests[CANDIDATE_WORKERS])}")
    per_run = requests[BASELINE_WORKERS].pop()
    bound = per_run * LATENCY_S
    goal = measure_goal(config, log)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"conveyor.ingest fetch with a ThreadPoolExecutor(max_workers={BASELINE_WORKERS}) as ctx.executor; "
                 "in the goal rows, the goal's bound on the wall, and the ideal",
        candidate=f"the same with max_workers={CANDIDATE_WORKERS} (a threads profile's max_workers); in the goal rows, "
                  f"fetch_sources of {GOAL_SOURCES} sources at max_workers={GOAL_WORKERS}: wall, and wall - start-up",
        repeats=repeats, metrics=[wall, rate, *goal_metrics(goal)],
        setup={"sources": f"{sources} CSV files of {rows_per_source} rows x {len(COLUMNS)} columns "
                          f"(~{sum(map(len, files.values())) / sources / 1e3:.0f} KB each), mode: files",
               "server": f"ThreadingHTTPServer on 127.0.0.1 in a process of its own, {LATENCY_S * 1e3:.0f} ms latency "
                         "per request, HTTP/1.1 keep-alive, TCP_NODELAY (as a remote server would be)",
               "requests per run": f"{per_run} ({per_run / sources:g} per source); at 1 transfer at a time the latency "
                                   f"alone is {bound:.1f} s",
               "warm-up": f"one run each of {WARM_UP_SOURCES} sources, not counted", **goal_setup(goal)},
        checks=[f"every run ingested all {len(expected)} rows, identical in content and order to the sources "
                "(content hash of the parquet parts)",
                f"every run made the same number of requests ({per_run}): no retry in any measured run",
                *goal_checks()],
        notes=[f"ideal ratio: about min({CANDIDATE_WORKERS}, {sources}) / 1 on the latency part; parsing and "
               "parquet writing (CPU, under the GIL) does not overlap as well on 2 cores", *goal_notes(goal)],
    )


if __name__ == "__main__":
    sys.exit(main())
