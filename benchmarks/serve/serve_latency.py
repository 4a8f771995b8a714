"""serve-latency: `conveyor serve-model` vs the bare FastAPI app a user would write, one row a request.

The question: what does conveyor's model service cost a client scoring online, one row per
request, against the service a user would write instead? Both serve the reference project's
model (the stacked XGBoost + torch MLP + logistic regression of ``configs/pipeline.yaml``'s
``model:`` section, trained once here by ``conveyor run``), loaded once with the project's
own ``tasks.predict.load`` and scored with its ``tasks.predict.score``; each is one uvicorn
process on 127.0.0.1 on a free port, both from this interpreter's environment (the same
FastAPI, uvicorn, torch and XGBoost).

- candidate: ``conveyor serve-model --port 0`` in the project: FastAPI on uvicorn; each
  request's body read under a size limit and validated against the model's feature list
  with a per-version TypedDict (every feature present, no other field, finite numbers),
  the rows scored on FastAPI's thread pool, the model version in every answer, uvicorn's
  access log at INFO, a thread watching the registry for a new champion.
- baseline: ``benchmarks/serve/bare_service.py``: a FastAPI app whose ``POST /predict`` takes a
  pydantic model ``rows: list[dict[str, float]]``, builds a DataFrame with the features in
  order and returns the scores; a plain ``def`` endpoint (FastAPI's thread pool), run with
  ``uvicorn.run(app, host, port)``: uvicorn's defaults, what ``uvicorn app:app`` gives.

The load: wrk (``apt-get install wrk``), 2 threads and 20 keep-alive connections sending 1-row
requests back to back for 30 s (5 s with ``--quick``), each body a row drawn with replacement from
the project's 569 raw rows (the 30 features in the model's order), the same draw for both sides.
The repetitions alternate between the two running servers (B C, C B, ...). Metrics per
repetition: wrk's median and 99th percentile latency and its throughput.

Before any ratio, on each server: 50 fixed rows, each sent alone, score as
``tasks.predict.score`` of that row computed in a separate process (relative 1e-9), and the 50
in one request as the 50 together; every request under load answered 2xx; conveyor's version
(its start-up line, ``/health``, every checked answer) is the one ``GET /model`` reports, and
``/model``'s features are stats.json's. Both servers stop on SIGINT and leave nothing behind.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil

from benchmarks.harness import Config, Metric, Result, check, interleaved, median
from benchmarks.overhead.reference import trained_reference
from benchmarks.processes import MIB, stop_group
from benchmarks.projects import cli, conveyor_command

NAME = "serve-latency"
DESCRIPTION = "HTTP latency of conveyor serve-model vs a bare FastAPI app with the same model (1-row requests)"
BARE = Path(__file__).resolve().parent / "bare_service.py"
THREADS = 20  # concurrent connections
WARMUP = 50  # the fixed rows, checked (and warming each server) before any measurement
RTOL = 1e-9
READY_S = 180.0  # from the command's start to GET /health answering 200
STOP_S = 30.0  # from SIGINT to the process gone (conveyor gives uvicorn 10 s to finish requests)
REQUEST_TIMEOUT_S = 60.0
POLL_S = 0.05
SEED = 20
SERVING = re.compile(r"serving model (\w+) \(([^)]*)\) at http://127\.0\.0\.1:(\d+) ")
UVICORN = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ")
HEADERS = {"Content-Type": "application/json"}
MODEL_FILES = {"stats": "data/processed/stats.json", "xgb": "models/xgb.json", "mlp": "models/mlp.pt",
               "stack": "models/stack.json"}  # configs/pipeline.yaml's model: section

EXPECTED = """\
import json, sys
from pathlib import Path
import pandas as pd
sys.path.insert(0, ".")
from tasks import predict
files, rows, fixed = json.loads(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), json.loads(sys.argv[3])
features = json.loads(Path(files["stats"]).read_text())["features"]
scorer = predict.load({name: Path(path) for name, path in files.items()})
single = [float(predict.score(scorer, pd.DataFrame([row], columns=features))[0]) for row in rows]
together = [float(s) for s in predict.score(scorer, pd.DataFrame([rows[i] for i in fixed], columns=features))]
print(json.dumps({"single": single, "batch": together}))
"""


# --- the servers ----------------------------------------------------------------------------


@dataclass
class Server:
    """One server process (its own process group), its output in files, its port once it is up."""

    side: str
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    port: int = 0
    version: str = ""  # conveyor: the version its start-up line names
    startup_s: float = 0.0  # from the start of the command to GET /health answering 200
    stop_s: float = 0.0
    exit_code: int | None = None

    def output(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")

    def tail(self) -> str:
        return f"stdout: {self.stdout.read_text(errors='replace')[-1500:]}\nstderr: " \
               f"{self.stderr.read_text(errors='replace')[-2500:]}"

    def rss_mib(self) -> float:
        with contextlib.suppress(psutil.Error):
            return float(psutil.Process(self.proc.pid).memory_info().rss) / MIB
        return float("nan")


def start(side: str, args: Sequence[str], cwd: Path, env: Mapping[str, str], logs: Path,
          announce: Callable[[str], re.Match[str] | None]) -> Server:
    """Start ``args``; wait (polling, up to READY_S) for ``announce`` to find its port in its output,
    then for ``GET /health`` to answer 200."""
    started = time.perf_counter()
    stdout, stderr = logs / f"{side}.out", logs / f"{side}.err"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(list(args), cwd=cwd, env=dict(env), stdout=out, stderr=err, start_new_session=True)
    server = Server(side, proc, stdout, stderr)
    deadline = started + READY_S
    while True:
        found = announce(server.output())
        if found is not None:
            server.port = int(found.group(found.lastindex or 0))
            if side == "conveyor":
                server.version = found.group(1)
            break
        check(proc.poll() is None, f"{side}: `{' '.join(args)}` exited {proc.returncode} before saying its port:\n"
                                   f"{server.tail()}")
        check(time.perf_counter() < deadline, f"{side}: no port announced within {READY_S:.0f} s:\n{server.tail()}")
        time.sleep(POLL_S)
    while True:
        with contextlib.suppress(OSError, http.client.HTTPException):
            status, _ = get(server.port, "/health", timeout=5.0)
            if status == 200:
                break
        check(proc.poll() is None, f"{side}: exited {proc.returncode} before /health answered:\n{server.tail()}")
        check(time.perf_counter() < deadline, f"{side}: GET /health did not answer 200 within {READY_S:.0f} s:\n"
                                              f"{server.tail()}")
        time.sleep(POLL_S)
    server.startup_s = time.perf_counter() - started
    return server


def stop(server: Server) -> None:
    """SIGINT, wait up to STOP_S (then SIGKILL its group); check it stopped by itself and left nothing."""
    proc = server.proc
    started = time.perf_counter()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)
    killed = False
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    server.stop_s, server.exit_code = time.perf_counter() - started, proc.returncode
    left = stop_group(proc.pid, grace_s=5.0)
    check(not killed, f"{server.side}: still running {STOP_S:.0f} s after SIGINT (killed):\n{server.tail()}")
    check(not left, f"{server.side}: processes of its group outlived it by 5 s (killed)")


def get(port: int, path: str, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post(port: int, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/predict", body, HEADERS)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# --- the load: wrk ---------------------------------------------------------------------------

WRK_SCRIPT = """\
-- every thread sends the rows of $BODIES (one JSON body a line) in order, round and round
local bodies = {}
for line in io.lines(os.getenv("BODIES")) do bodies[#bodies + 1] = line end
local sent = 0
request = function()
  sent = sent + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[(sent - 1) % #bodies + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "failed": %d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status + e.connect + e.read + e.write + e.timeout))
end
"""


@dataclass
class Figures:
    p50_ms: float
    p99_ms: float
    rate: float
    requests: int


def load(port: int, bodies: Path, seconds: float, scratch: Path) -> Figures:
    """wrk (``apt-get install wrk``): 2 threads, THREADS keep-alive connections, for ``seconds``; checked:
    no request failed or answered other than 2xx."""
    check(shutil.which("wrk") is not None, "wrk is not installed: apt-get install wrk (or brew install wrk)")
    script = scratch / "load.lua"
    script.write_text(WRK_SCRIPT)
    proc = subprocess.run(["wrk", "-t2", f"-c{THREADS}", f"-d{seconds:g}s", f"--timeout={REQUEST_TIMEOUT_S:g}s",
                           "-s", str(script), f"http://127.0.0.1:{port}/predict"], capture_output=True, text=True,
                          env={**os.environ, "BODIES": str(bodies)}, timeout=seconds + REQUEST_TIMEOUT_S + 30)
    check(proc.returncode == 0, f"wrk exited {proc.returncode}: {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    check(got["failed"] == 0 and got["requests"] > 0, f"wrk: {got['failed']} of {got['requests']} requests failed or "
                                                      f"were not answered 2xx:\n{proc.stdout[-2000:]}")
    return Figures(got["p50_us"] / 1000, got["p99_us"] / 1000, got["requests"] / (got["duration_us"] / 1e6),
                   got["requests"])


def check_scores(server: Server, rows: list[dict[str, float]], fixed: list[int], single: list[float],
                 batch: list[float]) -> float:
    """The fixed rows, each alone, then all in one request: the expected scores (relative RTOL), the model's
    version in each of conveyor's answers. The largest relative difference seen."""
    largest = 0.0
    for i in fixed:
        status, body = post(server.port, json.dumps({"rows": [rows[i]]}).encode())
        answer = json.loads(body) if status == 200 else {}
        check(status == 200 and len(answer.get("scores", [])) == 1, f"{server.side}: row {i}: {status} {body[:300]!r}")
        check(server.side != "conveyor" or answer.get("model") == server.version,
              f"conveyor: answered for model {answer.get('model')!r}, not {server.version}")
        largest = max(largest, abs(answer["scores"][0] - single[i]) / max(abs(single[i]), 1e-300))
    status, body = post(server.port, json.dumps({"rows": [rows[i] for i in fixed]}).encode())
    together = json.loads(body)["scores"] if status == 200 else []
    check(len(together) == len(fixed) and bool(np.allclose(together, batch, rtol=RTOL, atol=0)),
          f"{server.side}: the {len(fixed)} fixed rows in one request: {status} {body[:300]!r}")
    check(largest <= RTOL, f"{server.side}: a row scored {largest:.2g} (relative) from tasks.predict.score")
    return largest


# --- the benchmark --------------------------------------------------------------------------


def run(config: Config, log: Callable[[str], None]) -> Result:
    seconds = 5.0 if config.quick else 30.0
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-serve-"))
    logs = scratch / "logs"
    logs.mkdir()
    servers: list[Server] = []
    try:
        root, env = trained_reference(scratch, log, NAME)
        features = list(json.loads((root / "data/processed/stats.json").read_text())["features"])
        raw = pd.read_parquet(root / "data/raw").drop(columns=["target"])
        check(sorted(raw.columns) == sorted(features), f"data/raw's columns {sorted(raw.columns)} are not the "
                                                       f"model's features {features}")
        rows = [dict(zip(features, map(float, values), strict=True))
                for values in raw[features].to_numpy(dtype=np.float64)]
        rng = np.random.default_rng(SEED)
        fixed = [int(i) for i in rng.choice(len(rows), WARMUP, replace=False)]
        single, batch = _expected(root, env, scratch, rows, fixed)
        bodies = scratch / "bodies.jsonl"  # a draw with replacement, the same for both sides
        bodies.write_text("".join(json.dumps({"rows": [rows[int(i)]]}) + "\n"
                                  for i in rng.integers(0, len(rows), 10 * len(rows))))

        log(f"{NAME}: starting the bare app and conveyor serve-model")
        bare = start("bare", [sys.executable, str(BARE), str(root), "--port", "0"], root, env, logs, UVICORN.search)
        servers.append(bare)
        conveyor = start("conveyor", [conveyor_command(), "serve-model", "--port", "0"], root, env, logs,
                         SERVING.search)
        servers.append(conveyor)
        log(f"{NAME}: up in {bare.startup_s:.1f} s (bare), {conveyor.startup_s:.1f} s (conveyor, model "
            f"{conveyor.version})")
        card = _check_card(conveyor, features)
        largest = max(check_scores(server, rows, fixed, single, batch) for server in (bare, conveyor))
        log(f"{NAME}: checked and warmed up; {repeats} interleaved repetitions of wrk, {THREADS} connections, "
            f"{seconds:g} s")
        base, cand = interleaved(repeats, lambda _i: load(bare.port, bodies, seconds, scratch),
                                 lambda _i: load(conveyor.port, bodies, seconds, scratch), log)
        rss = {s.side: s.rss_mib() for s in servers}
        for server in list(servers):
            stop(server)
            servers.remove(server)
        stops = {s.side: (s.stop_s, s.exit_code) for s in (bare, conveyor)}
        startup = {s.side: s.startup_s for s in (bare, conveyor)}
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(base, cand, seconds, card, largest, stops, startup, rss)


def _expected(root: Path, env: Mapping[str, str], scratch: Path, rows: list[dict[str, float]],
              fixed: list[int]) -> tuple[list[float], list[float]]:
    """tasks.predict.score in a separate process in the project: every row alone, and the fixed rows together."""
    listed = scratch / "rows.json"
    listed.write_text(json.dumps(rows))
    out = cli([sys.executable, "-c", EXPECTED, json.dumps(MODEL_FILES), str(listed), json.dumps(fixed)], root,
              env).stdout
    scores = json.loads(out)
    single, together = [float(s) for s in scores["single"]], [float(s) for s in scores["batch"]]
    check(len(single) == len(rows) and len(together) == len(fixed), "the expected scores are not one per row")
    return single, together


def _check_card(conveyor: Server, features: list[str]) -> dict[str, Any]:
    status, body = get(conveyor.port, "/model")
    check(status == 200, f"conveyor: GET /model answered {status}: {body[:300]!r}")
    card: dict[str, Any] = json.loads(body)
    check(card.get("version") == conveyor.version, f"conveyor: GET /model says version {card.get('version')!r}, "
                                                   f"its start-up line {conveyor.version!r}")
    check(card.get("features") == features, "conveyor: GET /model's features are not stats.json's, in order")
    status, body = get(conveyor.port, "/health")
    check(status == 200 and json.loads(body).get("model") == conveyor.version,
          f"conveyor: GET /health answered {status} {body[:200]!r}, not model {conveyor.version}")
    return card


def _result(base: list[Figures], cand: list[Figures], seconds: float, card: Mapping[str, Any], largest: float,
            stops: Mapping[str, tuple[float, int | None]], startup: Mapping[str, float],
            rss: Mapping[str, float]) -> Result:
    p50 = Metric("p50 latency (ms), 1-row requests", [f.p50_ms for f in base], [f.p50_ms for f in cand])
    p99 = Metric("p99 latency (ms), 1-row requests", [f.p99_ms for f in base], [f.p99_ms for f in cand])
    rate = Metric("throughput (requests/s)", [f.rate for f in base], [f.rate for f in cand],
                  ratio="candidate/baseline", digits=1)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="benchmarks/serve/bare_service.py: FastAPI + pydantic `rows: list[dict[str, float]]`, the project's "
                 "tasks.predict load/score, uvicorn.run with uvicorn's defaults",
        candidate="`conveyor serve-model --port 0` (per-version TypedDict validation, body limit, model version in "
                  "every answer, uvicorn access log)",
        repeats=len(base), metrics=[p50, p99, rate],
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
        notes=[f"medians: p50 {median(p50.baseline):.2f} ms (bare) vs {median(p50.candidate):.2f} ms (conveyor); "
               f"p99 {median(p99.baseline):.2f} vs {median(p99.candidate):.2f} ms; throughput "
               f"{median(rate.baseline):.1f} vs {median(rate.candidate):.1f} requests/s",
               "the load is wrk's since 2026-11-26 (before: 20 Python threads sharing the benchmark's GIL, 100 "
               "requests each): its client costs less CPU, so absolute figures moved; the ratios compare",
               f"start-up (command to GET /health 200): bare {startup.get('bare', 0):.1f} s, conveyor "
               f"{startup.get('conveyor', 0):.1f} s; RSS after the last repetition: bare {rss.get('bare', 0):.0f} MiB, "
               f"conveyor {rss.get('conveyor', 0):.0f} MiB",
               "stop after SIGINT: " + ", ".join(f"{side} {s:.1f} s (exit {code})" for side, (s, code)
                                                 in stops.items())],
    )
