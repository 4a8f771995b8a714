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

The load: 20 client threads in this process, each with its own keep-alive
``http.client.HTTPConnection``, each sending 1-row requests back to back (a new one as soon
as the last is answered); every request's latency is taken from before it is sent to after
its body is read (``perf_counter``). The rows are drawn with replacement from the project's
569 raw rows (``data/raw``, less ``target``, the 30 features in the model's order), the same
rows in the same order for both sides in a repetition. Each server is warmed up first (50
requests, not counted); the repetitions then alternate between the two running servers
(B C, C B, ...). Metrics per repetition: the median and the 99th percentile of the
latencies, and the throughput (requests answered / wall of the repetition).

Before any ratio: every request was answered 200 with one score per row; for 50 fixed rows,
each sent alone, both servers' scores equal ``tasks.predict.score`` of that row computed in
a separate process (relative 1e-9), and so each other; the same 50 rows in one request equal
the score of the 50 together; every measured answer equals the expected score of the row it
sent; conveyor's version (its start-up line, ``/health``, every answer) is the one ``GET
/model`` reports, and ``/model``'s features are stats.json's. Both servers stop on SIGINT and
leave no process of their group behind.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
THREADS = 20  # concurrent clients
WARMUP = 50  # requests per server before any measurement, not counted (the 50 fixed rows)
RTOL = 1e-9
READY_S = 180.0  # from the command's start to GET /health answering 200
STOP_S = 30.0  # from SIGINT to the process gone (conveyor gives uvicorn 10 s to finish requests)
REQUEST_TIMEOUT_S = 60.0
POLL_S = 0.05
SEED = 20
SERVING = re.compile(r"serving model (\w+) \(([^)]*)\) at http://127\.0\.0\.1:(\d+) ")
UVICORN = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ")
ACCESS = re.compile(r'"POST /predict HTTP/1\.1" 200')
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


# --- the load -------------------------------------------------------------------------------


@dataclass
class Load:
    """What one burst of requests got: per request (row sent, status, body, seconds), and its wall."""

    answers: list[tuple[int, int, bytes]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0

    @property
    def statuses(self) -> Counter[int]:
        return Counter(status for _, status, _ in self.answers)


def load(port: int, plan: Sequence[Sequence[int]], bodies: Sequence[bytes]) -> Load:
    """One thread per entry of ``plan``, each on its own keep-alive connection (connected before the
    start), sending ``bodies[i]`` for each ``i`` of its entry back to back."""
    results: list[Load] = [Load() for _ in plan]
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(plan)
    barrier = threading.Barrier(len(plan) + 1, timeout=REQUEST_TIMEOUT_S)

    def client(k: int) -> None:
        result = results[k]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.connect()
        except OSError as exc:
            result.errors.append(f"connect: {exc!r}")
        barrier.wait()
        began = time.perf_counter()
        try:
            for row in plan[k]:
                sent = time.perf_counter()
                conn.request("POST", "/predict", bodies[row], HEADERS)
                response = conn.getresponse()
                body = response.read()
                result.latencies.append(time.perf_counter() - sent)
                result.answers.append((row, response.status, body))
        except (OSError, http.client.HTTPException) as exc:
            result.errors.append(f"thread {k}, request {len(result.answers) + 1}: {exc!r}")
        finally:
            spans[k] = (began, time.perf_counter())
            conn.close()

    threads = [threading.Thread(target=client, args=(k,), name=f"client-{k}", daemon=True) for k in range(len(plan))]
    for thread in threads:
        thread.start()
    barrier.wait()
    for thread in threads:
        thread.join()
    total = Load(wall=max(end for _, end in spans) - min(begin for begin, _ in spans))
    for result in results:
        total.answers += result.answers
        total.latencies += result.latencies
        total.errors += result.errors
    return total


def scores_of(load_: Load, side: str, version: str | None) -> dict[int, list[float]]:
    """Per row sent, the scores answered (checked: no error, every answer 200 with one score, and with
    ``version``, the model named in every answer)."""
    check(not load_.errors, f"{side}: {len(load_.errors)} requests failed: {load_.errors[:3]}")
    check(load_.statuses == Counter({200: len(load_.answers)}),
          f"{side}: not every request answered 200: {dict(load_.statuses)}; first other: "
          f"{next((b[:300] for _, s, b in load_.answers if s != 200), b'')!r}")
    got: dict[int, list[float]] = {}
    for row, _, body in load_.answers:
        answer = json.loads(body)
        check(isinstance(answer.get("scores"), list) and len(answer["scores"]) == 1
              and isinstance(answer["scores"][0], float), f"{side}: not one score for one row: {body[:300]!r}")
        if version is not None:
            check(answer.get("model") == version, f"{side}: answered for model {answer.get('model')!r}, "
                                                  f"not {version}")
        got.setdefault(row, []).append(answer["scores"][0])
    return got


def worst(got: Mapping[int, Sequence[float]], expected: Sequence[float], side: str, what: str) -> float:
    """Largest relative difference of ``got`` from ``expected[row]``; checked to be within RTOL."""
    largest = 0.0
    for row, values in got.items():
        want = expected[row]
        for value in values:
            diff = abs(value - want) / max(abs(want), 1e-300)
            check(diff <= RTOL, f"{side}: {what}: row {row} scored {value!r}, expected {want!r} (tasks.predict.score)")
            largest = max(largest, diff)
    return largest


# --- the benchmark --------------------------------------------------------------------------


@dataclass
class Figures:
    p50_ms: float
    p99_ms: float
    rate: float
    requests: int


def run(config: Config, log: Callable[[str], None]) -> Result:
    per_thread = 20 if config.quick else 100
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
        bodies = [json.dumps({"rows": [row]}).encode() for row in rows]
        rng = np.random.default_rng(SEED)
        fixed = [int(i) for i in rng.choice(len(rows), WARMUP, replace=False)]
        single, batch = _expected(root, env, scratch, rows, fixed)

        log(f"{NAME}: starting the bare app and conveyor serve-model")
        bare = start("bare", [sys.executable, str(BARE), str(root), "--port", "0"], root, env, logs, UVICORN.search)
        servers.append(bare)
        conveyor = start("conveyor", [conveyor_command(), "serve-model", "--port", "0"], root, env, logs,
                         SERVING.search)
        servers.append(conveyor)
        log(f"{NAME}: up in {bare.startup_s:.1f} s (bare), {conveyor.startup_s:.1f} s (conveyor, model "
            f"{conveyor.version})")
        card = _check_card(conveyor, features)

        warm_plan = [fixed[k::THREADS] for k in range(THREADS)]
        agreement = 0.0
        for server in (bare, conveyor):
            version = conveyor.version if server is conveyor else None
            agreement = max(agreement, worst(scores_of(load(server.port, warm_plan, bodies), server.side, version),
                                             single, server.side, "warm-up (the fixed rows, one a request)"))
            status, body = post(server.port, json.dumps({"rows": [rows[i] for i in fixed]}).encode())
            check(status == 200, f"{server.side}: the {WARMUP} fixed rows in one request: {status} {body[:300]!r}")
            together = json.loads(body)["scores"]
            check(len(together) == WARMUP and bool(np.allclose(together, batch, rtol=RTOL, atol=0)),
                  f"{server.side}: the {WARMUP} fixed rows in one request scored {together[:3]}..., expected "
                  f"{batch[:3]}...")
        log(f"{NAME}: warmed up; {repeats} interleaved repetitions of {THREADS} threads x {per_thread} requests")
        largest = [agreement]

        def side(server: Server) -> Callable[[int], Figures]:
            def once(i: int) -> Figures:
                picks = np.random.default_rng(SEED + 1 + i).integers(0, len(rows), (THREADS, per_thread))
                result = load(server.port, [[int(r) for r in line] for line in picks], bodies)
                got = scores_of(result, server.side, conveyor.version if server is conveyor else None)
                check(len(result.answers) == THREADS * per_thread, f"{server.side}: {len(result.answers)} answers, "
                                                                   f"not {THREADS * per_thread}")
                largest.append(worst(got, single, server.side, f"repetition {i + 1}"))
                ms = np.asarray(result.latencies) * 1000
                return Figures(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                               len(result.answers) / result.wall, len(result.answers))
            return once

        base, cand = interleaved(repeats, side(bare), side(conveyor), log)
        rss = {s.side: s.rss_mib() for s in servers}
        for server in list(servers):
            stop(server)
            servers.remove(server)
        sent = {s.side: WARMUP + 1 + sum(f.requests for f in figures)  # POST /predict: warm-up, batch, measured
                for s, figures in ((bare, base), (conveyor, cand))}
        access = {s.side: len(ACCESS.findall(s.output())) for s in (bare, conveyor)}
        stops = {s.side: (s.stop_s, s.exit_code) for s in (bare, conveyor)}
        startup = {s.side: s.startup_s for s in (bare, conveyor)}
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(base, cand, per_thread, card, max(largest), sent, access, stops, startup, rss)


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


def _result(base: list[Figures], cand: list[Figures], per_thread: int, card: Mapping[str, Any], largest: float,
            sent: Mapping[str, int], access: Mapping[str, int], stops: Mapping[str, tuple[float, int | None]],
            startup: Mapping[str, float], rss: Mapping[str, float]) -> Result:
    p50 = Metric("p50 latency (ms), 1-row requests", [f.p50_ms for f in base], [f.p50_ms for f in cand])
    p99 = Metric("p99 latency (ms), 1-row requests", [f.p99_ms for f in base], [f.p99_ms for f in cand])
    rate = Metric("throughput (requests/s)", [f.rate for f in base], [f.rate for f in cand],
                  ratio="candidate/baseline", digits=1)
    stacks = ", ".join(f"{name} {'installed' if importlib.util.find_spec(name) else 'not installed'}"
                       for name in ("httptools", "uvloop"))
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="benchmarks/serve/bare_service.py: FastAPI + pydantic `rows: list[dict[str, float]]`, the project's "
                 "tasks.predict load/score, uvicorn.run with uvicorn's defaults",
        candidate="`conveyor serve-model --port 0` (per-version TypedDict validation, body limit, model version in "
                  "every answer, uvicorn access log)",
        repeats=len(base), metrics=[p50, p99, rate],
        setup={"model": f"the reference project's stacked model (XGBoost + torch MLP + logistic regression), "
                        f"trained once by `conveyor run`; version {card.get('version')} ({card.get('source')})",
               "load": f"{THREADS} client threads in the benchmark process, one keep-alive http.client connection "
                       f"each, {per_thread} 1-row requests each back to back ({THREADS * per_thread} a repetition "
                       f"a side)",
               "rows": "drawn with replacement from data/raw's 569 rows (30 features, the model's order), the same "
                       "draw for both sides in a repetition",
               "warm-up": f"{WARMUP} requests per server (the fixed rows, one a request, {THREADS} threads), then "
                          f"the {WARMUP} in one request; not counted",
               "servers": f"one uvicorn process each on 127.0.0.1, both up before the first repetition and kept "
                          f"up; h11 and asyncio on both ({stacks}); stdout and stderr to files",
               "latency": "perf_counter from before sending a request to after reading its body; throughput is "
                          "answers / (last thread done - first thread started)",
               "cores": str(os.cpu_count())},
        checks=["every request (warm-up, batch, measured) answered 200 with one score per row, none failed",
                f"the {WARMUP} fixed rows, each alone: both servers' scores equal tasks.predict.score of that row "
                f"in a separate process (relative {RTOL:g}); the {WARMUP} in one request equal their score together",
                f"every measured answer equals the expected score of the row it sent (relative {RTOL:g}); largest "
                f"difference seen {largest:.2g}",
                f"conveyor's model {card.get('version')}: its start-up line, GET /health and every answer name "
                "the version GET /model reports; /model's features are stats.json's, in order",
                "both servers stopped on SIGINT within "
                f"{STOP_S:.0f} s and left no process of their group 5 s later"],
        notes=[f"medians: p50 {median(p50.baseline):.2f} ms (bare) vs {median(p50.candidate):.2f} ms (conveyor); "
               f"p99 {median(p99.baseline):.2f} vs {median(p99.candidate):.2f} ms; throughput "
               f"{median(rate.baseline):.1f} vs {median(rate.candidate):.1f} requests/s",
               f"model version {card.get('version')} ({card.get('source')})",
               f"the {THREADS} client threads share this process's GIL and the machine's {os.cpu_count()} cores "
               "with the server under test, the same for both sides; latency includes the client's own Python "
               "time, so both absolute figures are above what an outside client would see",
               f"access log: both servers log one uvicorn access line per request (uvicorn's default access_log "
               f"and INFO level, to stdout; here a file): {access.get('bare')} `POST /predict 200` lines from the "
               f"bare app, {access.get('conveyor')} from conveyor, for {sent.get('bare')} and {sent.get('conveyor')} "
               "POST /predict sent to each",
               "the bare app runs uvicorn.run(app, host, port) and nothing else: uvicorn's defaults, as "
               "`uvicorn app:app` (access log on, keep-alive 5 s, h11/asyncio here); conveyor's serve-model also "
               "sets log_level info and timeout_graceful_shutdown 10",
               "both score on FastAPI's thread pool (conveyor: run_in_threadpool; bare: a plain def endpoint), "
               "so up to 40 requests score at once on either; torch and XGBoost use their default threads",
               f"start-up (command to GET /health 200, the model's load included): bare {startup.get('bare', 0):.1f}"
               f" s, conveyor {startup.get('conveyor', 0):.1f} s; RSS after the last repetition: bare "
               f"{rss.get('bare', 0):.0f} MiB, conveyor {rss.get('conveyor', 0):.0f} MiB",
               "stop after SIGINT: " + ", ".join(f"{side} {s:.1f} s (exit {code})" for side, (s, code)
                                                 in stops.items())],
    )
