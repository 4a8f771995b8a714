"""ingest-concurrency: ``tasks.ingest:fetch`` (conveyor.ingest) over HTTP with latency, 1 transfer at a time vs 8.

Many small CSV sources behind a server that answers each request 100 ms late: the
ingest is waiting, not computing, so a thread pool of 8 should finish several times
sooner than one of 1. The task is called directly with a StageContext whose executor is
the pool (as the ``threads`` profile gives it); each run writes a fresh ``data/raw``.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved, timed
from benchmarks.latency_server import LatencyServer
from benchmarks.stages import context, digest, read_parts

NAME = "ingest-concurrency"
DESCRIPTION = "ingest (files mode) of small CSV sources over HTTP with fixed latency per request"
COLUMNS = ["a", "b", "c", "d", "label"]
LATENCY_S = 0.1
BASELINE_WORKERS = 1
CANDIDATE_WORKERS = 8
WARM_UP_SOURCES = 2


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
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"conveyor.ingest fetch with a ThreadPoolExecutor(max_workers={BASELINE_WORKERS}) as ctx.executor",
        candidate=f"the same with max_workers={CANDIDATE_WORKERS} (a threads profile's max_workers)",
        repeats=repeats, metrics=[wall, rate],
        setup={"sources": f"{sources} CSV files of {rows_per_source} rows x {len(COLUMNS)} columns "
                          f"(~{sum(map(len, files.values())) / sources / 1e3:.0f} KB each), mode: files",
               "server": f"ThreadingHTTPServer on 127.0.0.1, {LATENCY_S * 1e3:.0f} ms latency per request, "
                         "HTTP/1.0 (one connection per request)",
               "requests per run": f"{per_run} (HEAD + GET per source); at 1 transfer at a time the latency "
                                   f"alone is {bound:.1f} s",
               "warm-up": f"one run each of {WARM_UP_SOURCES} sources, not counted"},
        checks=[f"every run ingested all {len(expected)} rows, identical in content and order to the sources "
                "(content hash of the parquet parts)",
                f"every run made the same number of requests ({per_run}): no retry in any measured run"],
        notes=[f"ideal ratio: about min({CANDIDATE_WORKERS}, {sources}) / 1 on the latency part; parsing and "
               "parquet writing (CPU, under the GIL) does not overlap as well on 2 cores"],
    )
