"""ingest-concurrency: ``tasks.ingest:fetch`` (conveyor.ingest) over HTTP with latency, 1 transfer at a time vs 8.

CSV sources behind an HTTP server in a process of its own (``_Handler``, 100 ms a request). Goal (issue 14, item 4):
``fetch_sources`` of 64 sources at max_workers 16 within 1.25 x ceil(64/16) x 0.1 s + start-up (its wall on 1 source
less latency). Checked: each call made one GET a source, the same requests every time, a part a source, the rows.
"""

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.stages import context, digest, read_parts

NAME = "ingest-concurrency"
DESCRIPTION = "ingest (files mode) of small CSV sources over HTTP with fixed latency per request"
COLUMNS, LATENCY_S, BASELINE_WORKERS, CANDIDATE_WORKERS = ["a", "b", "c", "d", "label"], 0.1, 1, 8
GOAL_SOURCES, GOAL_WORKERS, GOAL_EFFICIENCY, GOAL_ROWS = 64, 16, 0.8, 1000  # rows per source: ~47 KB
GOAL_IDEAL_S = -(-GOAL_SOURCES // GOAL_WORKERS) * LATENCY_S  # ceil(64 / 16) x the latency


def fetch(port: int, root: Path, files: dict[str, bytes], workers: int, task: bool, i: int) -> tuple[float, int, float]:
    """``tasks.ingest:fetch`` (``task``) or ``fetch_sources`` on ``workers`` threads, checked: wall, requests, GETs."""
    import pandas as pd

    from conveyor.ingest import fetch_sources
    from tasks.ingest import fetch as fetch_task

    params = {"sources": [f"http://127.0.0.1:{port}/{name}" for name in files], "columns": COLUMNS,
              "skip_rows": 1, "mode": "files", "dtype": "float64", "timeout_s": 30,
              "retry": {"attempts": 3, "initial_delay_s": 0.05, "max_delay_s": 0.2}}  # a retry fails the checks
    n, out, what = len(files), root / f"run-{workers}-{len(files)}-{i}", f"{len(files)} sources, max_workers={workers}"
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"bench-ingest-{workers}") as pool:
        mark, started = (root / "arrivals").stat().st_size, time.perf_counter()
        if task:
            fetch_task(context("ingest", out, params={"ingest": params}, outs={"data/raw": out}, executor=pool,
                               n_workers=workers))
        else:
            done = fetch_sources(params, out, executor=pool)
        wall = time.perf_counter() - started
    arrived = [line.split() for line in (root / "arrivals").read_text()[mark:].splitlines()]  # a line a request
    gets = sorted(float(at) - started for method, at in arrived if method == "GET")
    check(len(gets) == n, f"{what}: {len(gets)} GET of {len(arrived)} requests; expected one GET per source")
    check(task or (done.retries, done.sources, done.parts, done.bytes) == (0, n, n, sum(map(len, files.values()))),
          f"{what}: reported {None if task else done}, expected no retry, {n} sources and parts, the bytes served")
    parts = {int(m[1]) for p in out.glob("*") if (m := re.fullmatch(r"part-(\d{5})(-\d{4})?\.parquet", p.name))}
    check(parts == set(range(n)), f"{what}: no parquet part for source(s) {sorted(set(range(n)) - parts)}")
    want = pd.concat([pd.read_csv(root / name, skiprows=1, header=None, names=COLUMNS) for name in files],
                     ignore_index=True).astype("float64")
    check(digest(read_parts(out)) == digest(want), f"{what}: the ingested rows differ from the sources' (or order)")
    return wall, len(arrived), gets[-1] - gets[0]


def run(config: Config, log: Callable[[str], None]) -> Result:
    import numpy as np
    import pandas as pd

    (sources, rows), repeats = (12, 1000) if config.quick else (24, 2000), config.reps(full=5, quick=3)
    files, goal = ({f"{kind}-{i:03d}.csv": pd.DataFrame(np.random.default_rng(at + i).normal(size=(n, len(COLUMNS)))
                    .round(6), columns=COLUMNS).to_csv(index=False).encode() for i in range(count)}
                   for kind, count, n, at in (("export", sources, rows, 0), ("source", GOAL_SOURCES, GOAL_ROWS, 1000)))
    with scratch(NAME) as root, subprocess.Popen([sys.executable, "-m", __name__, str(root)], cwd=REPO,
                                                 text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as server:
        for name, body in (files | goal).items():  # served from disk; the server's stdin closed at the end: it exits
            (root / name).write_bytes(body)
        port = int(server.stdout.readline() or 0) if server.stdout else 0
        check(port > 0, f"the latency server did not start (exit {server.poll()})")

        log(f"{NAME}: a warm-up, then {repeats} interleaved repetitions of max_workers 1 and 8, the goal's 1 and 64")
        for workers, which in ((BASELINE_WORKERS, files), (CANDIDATE_WORKERS, files), (GOAL_WORKERS, goal)):
            fetch(port, root, dict(list(which.items())[:2 if which is files else None]), workers, which is files, -1)
        base, cand = interleaved(repeats, partial(fetch, port, root, files, BASELINE_WORKERS, True),
                                 partial(fetch, port, root, files, CANDIDATE_WORKERS, True), log)
        one, many = interleaved(repeats, partial(fetch, port, root, dict(list(goal.items())[:1]), GOAL_WORKERS, False),
                                partial(fetch, port, root, goal, GOAL_WORKERS, False), log)
    for what, calls in (("the main runs", base + cand), ("1 source", one), (f"{GOAL_SOURCES} sources", many)):
        check(len({c[1] for c in calls}) == 1, f"{what}: the requests per call differ (a retry?): {calls}")
    startups, where = [c[0] - c[1] * LATENCY_S for c in one], f"{GOAL_SOURCES} sources @ max_workers {GOAL_WORKERS}"
    bound = Metric(f"goal, {where}: bound {1 / GOAL_EFFICIENCY:g} x ideal + start-up vs wall (s); ratio >= 1",
                   [GOAL_IDEAL_S / GOAL_EFFICIENCY + s for s in startups], [c[0] for c in many], digits=3)
    ideal = Metric(f"goal, {where}: ideal {GOAL_IDEAL_S:g} vs wall - start-up (s); ratio = efficiency >= "
                   f"{GOAL_EFFICIENCY:.2f}", [GOAL_IDEAL_S] * repeats,
                   [c[0] - s for c, s in zip(many, startups, strict=True)], digits=3)
    efficiency = median(ideal.ratios())
    return Result(
        name=NAME, description=DESCRIPTION, setup={"sources": f"{sources} CSV files of {rows} rows"},
        baseline=f"ctx.executor: a ThreadPoolExecutor(max_workers={BASELINE_WORKERS}); goal rows: the bound, the ideal",
        candidate=f"max_workers={CANDIDATE_WORKERS}; goal rows: fetch_sources of {GOAL_SOURCES} at {GOAL_WORKERS}",
        repeats=repeats, metrics=[Metric("wall time of fetch (s)", [c[0] for c in base], [c[0] for c in cand]),
                                  Metric("rows/s", [sources * rows / c[0] for c in base],
                                         [sources * rows / c[0] for c in cand], ratio="candidate/baseline", digits=0),
                                  bound, ideal],
        notes=[f"goal (issue 14, item 4): {where}, {LATENCY_S * 1e3:.0f} ms latency: wall <= {1 / GOAL_EFFICIENCY:g} x "
               f"{GOAL_IDEAL_S:g} s + start-up: {met(median(bound.ratios()) >= 1)}; efficiency ideal / (wall - start-up"
               f") {efficiency:.2f} (median; goal >= {GOAL_EFFICIENCY:.2f}): {met(efficiency >= GOAL_EFFICIENCY)}; "
               f"start-up {median(startups):.3f} s; the GETs arrived over {median([c[2] for c in many]):.3f} s"])


class _Handler(SimpleHTTPRequestHandler):  # the server's: each request noted in ROOT/arrivals, answered LATENCY_S late
    protocol_version, disable_nagle_algorithm = "HTTP/1.1", True  # keep-alive; a body goes out with its headers

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        os.write(LOG, f"{self.command} {time.perf_counter()!r}\n".encode())  # O_APPEND: one line, whole
        time.sleep(LATENCY_S)
        return super().send_head()


if __name__ == "__main__":  # ``python -m benchmarks.compute.ingest_concurrency ROOT``: serve ROOT's files
    LOG = os.open(f"{sys.argv[1]}/arrivals", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    ThreadingHTTPServer.daemon_threads, ThreadingHTTPServer.request_queue_size = True, 128  # 5 drops some of 8 connects
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=sys.argv[1]))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()  # until the client closes it, or is gone
