"""serve-latency: `conveyor serve-model` vs the bare FastAPI app a user would write, one row a request.

Both serve the reference project's stacked model (trained once here by ``conveyor run``), loaded once with
the project's ``tasks.predict.load`` and scored with its ``score``, one uvicorn process each on 127.0.0.1
(``--port 0``), from this environment. Candidate: ``conveyor serve-model`` (a size-limited body validated
per model version, the version in every answer, uvicorn's access log, a thread watching the registry).
Baseline: ``bare_service.py`` (pydantic ``rows: list[dict[str, float]]``, uvicorn's defaults). The load is
wrk's: 2 threads, 20 keep-alive connections sending 1-row requests (rows of the project's data drawn with
replacement, the same for both) back to back for 30 s (5 s with ``--quick``), alternating between the two
running servers; wrk's p50, p99 and throughput. Checked first on each: 50 fixed rows, each alone, score as
``tasks.predict.score`` of that row in a separate process (relative 1e-9), and together as the 50 together;
conveyor's version (start-up line, ``/health``, every answer) is ``GET /model``'s, whose features are
stats.json's; under load every request answered 2xx; both stop on SIGINT, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil

from benchmarks.harness import Config, Metric, Result, check, interleaved
from benchmarks.overhead.reference import trained_reference
from benchmarks.processes import MIB, stop_group
from benchmarks.projects import cli, conveyor_command

NAME = "serve-latency"
DESCRIPTION = "HTTP latency of conveyor serve-model vs a bare FastAPI app with the same model (1-row requests)"
HERE = Path(__file__).resolve().parent
THREADS = 20  # concurrent connections
WARMUP = 50  # the fixed rows, checked (and warming each server) before any measurement
RTOL = 1e-9
READY_S, STOP_S, TIMEOUT_S = 180.0, 30.0, 60.0  # start to /health 200; SIGINT to gone; any request
ANNOUNCE = {"bare": re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+) "),
            "conveyor": re.compile(r"serving model (\w+) \([^)]*\) at http://127\.0\.0\.1:(\d+) ")}
EXPECTED = """\
import json, sys
from pathlib import Path
import pandas as pd
sys.path.insert(0, sys.argv[1])
from plain_predict import load_model
features, scorer, score = load_model(Path("."))
rows, fixed = json.loads(Path(sys.argv[2]).read_text()), json.loads(sys.argv[3])
single = [float(score(scorer, pd.DataFrame([row], columns=features))[0]) for row in rows]
together = [float(s) for s in score(scorer, pd.DataFrame([rows[i] for i in fixed], columns=features))]
print(json.dumps({"single": single, "batch": together}))
"""
WRK = """\
local bodies, sent = {}, 0
for line in io.lines(os.getenv("BODIES")) do bodies[#bodies + 1] = line end
request = function()
  sent = sent + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[(sent - 1) % #bodies + 1])
end
done = function(s, latency, requests)
  local e = s.errors
  io.write(string.format('{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "failed": %d}\\n',
    s.requests, s.duration, latency:percentile(50), latency:percentile(99),
    e.status + e.connect + e.read + e.write + e.timeout))
end
"""


def call(port: int, path: str, body: Any = None) -> tuple[int, Any]:
    """GET ``path`` (or POST ``body`` as JSON): the status and the parsed answer (None where it is not JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("GET" if body is None else "POST", path, None if body is None else json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
    finally:
        conn.close()
    with contextlib.suppress(ValueError):
        return response.status, json.loads(text)
    return response.status, None


def start(side: str, args: list[str], root: Path, env: Mapping[str, str], logs: Path) -> dict[str, Any]:
    """Start a server; wait for its port in its output, then for ``GET /health`` 200: its process, port, version
    (conveyor's start-up line) and seconds to start."""
    started, out = time.perf_counter(), logs / f"{side}.log"
    with out.open("wb") as log:
        proc = subprocess.Popen(args, cwd=root, env=dict(env), stdout=log, stderr=log, start_new_session=True)
    server: dict[str, Any] = {"side": side, "proc": proc, "log": out, "port": 0, "version": ""}
    while True:
        if not server["port"] and (found := ANNOUNCE[side].search(out.read_text(errors="replace"))):
            server.update(port=int(found[found.lastindex or 0]), version=found[1] if side == "conveyor" else "")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if server["port"] and call(server["port"], "/health")[0] == 200:
                return {**server, "startup_s": time.perf_counter() - started}
        check(proc.poll() is None and time.perf_counter() < started + READY_S, f"{side}: exited {proc.poll()} or not "
              f"up within {READY_S:.0f} s:\n{out.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)


def stop(server: dict[str, Any]) -> str:
    """SIGINT; checked: gone by itself within STOP_S and its group 5 s later (else killed). How long, its exit."""
    proc, started = server["proc"], time.perf_counter()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_S)
    took, stopped = time.perf_counter() - started, proc.poll() is not None
    left = stop_group(proc.pid, grace_s=5.0 if stopped else 0)
    proc.wait()
    check(stopped, f"{server['side']}: still running {STOP_S:.0f} s after SIGINT (killed)")
    check(not left, f"{server['side']}: processes of its group outlived it by 5 s (killed)")
    return f"{server['side']} {took:.1f} s (exit {proc.returncode})"


def load(port: int, bodies: Path, seconds: float, script: Path) -> dict[str, float]:
    """wrk, 2 threads, THREADS connections, ``seconds``; checked: no request failed or answered other than 2xx."""
    check(shutil.which("wrk") is not None, "wrk is not installed: apt-get install wrk (or brew install wrk)")
    proc = subprocess.run(["wrk", "-t2", f"-c{THREADS}", f"-d{seconds:g}s", f"--timeout={TIMEOUT_S:g}s", "-s",
                           str(script), f"http://127.0.0.1:{port}/predict"], capture_output=True, text=True,
                          env={**os.environ, "BODIES": str(bodies)}, timeout=seconds + TIMEOUT_S + 30)
    check(proc.returncode == 0, f"wrk exited {proc.returncode}: {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    check(got["failed"] == 0 and got["requests"] > 0, f"wrk: {got['failed']} of {got['requests']} requests failed or "
                                                      f"were not answered 2xx:\n{proc.stdout[-2000:]}")
    return {"p50": got["p50_us"] / 1000, "p99": got["p99_us"] / 1000,
            "rate": got["requests"] / (got["duration_us"] / 1e6)}


def check_scores(server: Mapping[str, Any], rows: list[dict[str, float]], fixed: list[int], single: list[float],
                 batch: list[float]) -> float:
    """The fixed rows alone, then together: tasks.predict.score's scores, conveyor's version; the largest relative
    difference seen."""
    side, port, largest = server["side"], server["port"], 0.0
    for i in fixed:
        status, answer = call(port, "/predict", {"rows": [rows[i]]})
        check(status == 200 and len(answer.get("scores", [])) == 1, f"{side}: row {i}: {status} {answer}")
        check(side != "conveyor" or answer.get("model") == server["version"],
              f"conveyor: answered for model {answer.get('model')!r}, not {server['version']}")
        largest = max(largest, abs(answer["scores"][0] - single[i]) / max(abs(single[i]), 1e-300))
    status, answer = call(port, "/predict", {"rows": [rows[i] for i in fixed]})
    together = answer.get("scores", []) if status == 200 else []
    check(len(together) == len(fixed) and bool(np.allclose(together, batch, rtol=RTOL, atol=0)),
          f"{side}: the {len(fixed)} fixed rows in one request: {status} {str(answer)[:300]}")
    check(largest <= RTOL, f"{side}: a row scored {largest:.2g} (relative) from tasks.predict.score")
    return largest


def run(config: Config, log: Callable[[str], None]) -> Result:
    seconds, repeats = 5.0 if config.quick else 30.0, config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-serve-"))
    servers: list[dict[str, Any]] = []
    try:
        root, env = trained_reference(scratch, log, NAME)
        features = list(json.loads((root / "data/processed/stats.json").read_text())["features"])
        raw = pd.read_parquet(root / "data/raw").drop(columns=["target"])
        check(sorted(raw.columns) == sorted(features), f"data/raw's columns are not the model's features {features}")
        rows = [dict(zip(features, map(float, values), strict=True)) for values in raw[features].to_numpy("float64")]
        rng = np.random.default_rng(20)
        fixed = [int(i) for i in rng.choice(len(rows), WARMUP, replace=False)]
        (scratch / "rows.json").write_text(json.dumps(rows))
        expected = json.loads(cli([sys.executable, "-c", EXPECTED, str(HERE), str(scratch / "rows.json"),
                                   json.dumps(fixed)], root, env).stdout)
        single, batch = [float(s) for s in expected["single"]], [float(s) for s in expected["batch"]]
        check(len(single) == len(rows) and len(batch) == len(fixed), "the expected scores are not one per row")
        bodies, script = scratch / "bodies.jsonl", scratch / "load.lua"  # a draw with replacement, for both sides
        bodies.write_text("".join(json.dumps({"rows": [rows[int(i)]]}) + "\n"
                                  for i in rng.integers(0, len(rows), 10 * len(rows))))
        script.write_text(WRK)
        log(f"{NAME}: starting the bare app and conveyor serve-model")
        (scratch / "logs").mkdir()
        for side, args in (("bare", [sys.executable, str(HERE / "bare_service.py"), str(root), "--port", "0"]),
                           ("conveyor", [conveyor_command(), "serve-model", "--port", "0"])):
            servers.append(start(side, args, root, env, scratch / "logs"))
        bare, conveyor = servers
        status, card = call(conveyor["port"], "/model")
        check(status == 200 and card.get("version") == conveyor["version"] and card.get("features") == features,
              f"conveyor: GET /model answered {status} {str(card)[:300]}, not version {conveyor['version']} with "
              "stats.json's features in order")
        status, health = call(conveyor["port"], "/health")
        check(status == 200 and health.get("model") == conveyor["version"], f"conveyor: GET /health: {health}")
        largest = max(check_scores(server, rows, fixed, single, batch) for server in servers)
        log(f"{NAME}: checked and warmed up; {repeats} interleaved repetitions of wrk, {THREADS} connections")
        base, cand = interleaved(repeats, lambda _i: load(bare["port"], bodies, seconds, script),
                                 lambda _i: load(conveyor["port"], bodies, seconds, script), log)
        rss = {s["side"]: psutil.Process(s["proc"].pid).memory_info().rss / MIB for s in servers}
        stops = [stop(servers.pop(0)) for _ in range(2)]
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server["proc"].pid, signal.SIGKILL)
            server["proc"].wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="benchmarks/serve/bare_service.py: FastAPI + pydantic `rows: list[dict[str, float]]`, the project's "
                 "tasks.predict load/score, uvicorn.run with uvicorn's defaults",
        candidate="`conveyor serve-model --port 0` (per-version TypedDict validation, body limit, model version in "
                  "every answer, uvicorn access log)",
        repeats=repeats, metrics=[
            *(Metric(f"{k} latency (ms), 1-row requests", [f[k] for f in base], [f[k] for f in cand])
              for k in ("p50", "p99")),
            Metric("throughput (requests/s)", [f["rate"] for f in base], [f["rate"] for f in cand],
                   ratio="candidate/baseline", digits=1)],
        setup={"model": f"the reference project's stacked model, version {card.get('version')} ({card.get('source')})",
               "load": f"wrk -t2 -c{THREADS} -d{seconds:g}s: {THREADS} keep-alive connections sending 1-row requests "
                       "back to back; latency and throughput are wrk's (HdrHistogram)",
               "cores": str(os.cpu_count())},
        checks=["every request answered 2xx (wrk counts the others and every socket error: none)",
                f"the {WARMUP} fixed rows, each alone, and the {WARMUP} in one request: both servers' scores equal "
                f"tasks.predict.score in a separate process (relative {RTOL:g}; largest seen {largest:.2g})",
                f"conveyor's model {card.get('version')}: its start-up line, GET /health and every checked answer "
                "name the version GET /model reports; /model's features are stats.json's, in order",
                f"both servers stopped on SIGINT within {STOP_S:.0f} s and left no process of their group 5 s later"],
        notes=[f"start-up (command to GET /health 200): bare {bare['startup_s']:.1f} s, conveyor "
               f"{conveyor['startup_s']:.1f} s; RSS after the last repetition: bare {rss['bare']:.0f} MiB, conveyor "
               f"{rss['conveyor']:.0f} MiB; stop after SIGINT: {', '.join(stops)}"],
    )
