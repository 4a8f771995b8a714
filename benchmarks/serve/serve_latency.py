"""serve-latency: `conveyor serve-model` vs the bare FastAPI app a user would write, one row a request.

Both serve the reference model (trained here) on 127.0.0.1; wrk (2 threads, 20 keep-alive connections, the same 1-row
requests) loads each in turn, 30 s (5 s ``--quick``). Checked: 50 fixed rows, alone and together, score as
``tasks.predict.score`` (relative 1e-9); conveyor's start-up line, ``/health`` and answers name ``/model``'s version
(features stats.json's); no request fails under load; both stop on SIGINT, leaving nothing."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.harness import Config, Metric, Result, check, interleaved, scratch
from benchmarks.overhead.reference import trained_reference
from benchmarks.processes import stop_group
from benchmarks.serve.plain import load_model

NAME = "serve-latency"
DESCRIPTION = "HTTP latency of conveyor serve-model vs a bare FastAPI app with the same model (1-row requests)"
THREADS, WARMUP, RTOL, READY_S, STOP_S, TIMEOUT_S = 20, 50, 1e-9, 180.0, 30.0, 60.0  # s: to up, to stop, a request
ANNOUNCE = {"bare": re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+) "),
            "conveyor": re.compile(r"serving model (\w+) \([^)]*\) at http://127\.0\.0\.1:(\d+) ")}
WRK = """\
local bodies, sent = {}, 0 wrk.headers["Content-Type"] = "application/json"
for line in io.lines(os.getenv("BODIES")) do bodies[#bodies + 1] = line end
request = function() sent = sent + 1 return wrk.format("POST", "/predict", nil, bodies[(sent - 1) % #bodies + 1]) end
done = function(s, latency) local e = s.errors io.write(string.format('{"requests": %d, "duration_us": %d, "p50_us": '
  .. '%d, "p99_us": %d, "failed": %d}\\n', s.requests, s.duration, latency:percentile(50), latency:percentile(99),
  e.status + e.connect + e.read + e.write + e.timeout)) end
"""


def call(port: int, path: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", None if body is None else
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, None


@contextmanager
def serving(side: str, args: list[str], root: Path, env: dict[str, str], out: Path) -> Iterator[dict[str, Any]]:
    """A server once ``GET /health`` answers 200 on the port it logged; at the end SIGINT, checked to stop it."""
    started = time.perf_counter()
    with out.open("wb") as log:
        proc = subprocess.Popen(args, cwd=root, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        while True:
            with contextlib.suppress(OSError):
                if (found := ANNOUNCE[side].search(out.read_text(errors="replace"))) and call(
                        port := int(found[found.lastindex or 0]), "/health")[0] == 200:
                    break
            check(proc.poll() is None and time.perf_counter() < started + READY_S, f"{side}: exited {proc.poll()} or "
                  f"not up within {READY_S:.0f} s:\n{out.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        yield {"side": side, "port": port, "startup_s": time.perf_counter() - started,
               "version": found[1] if side == "conveyor" else None}
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_S)
        check(not stop_group(proc.pid, grace_s=0 if proc.poll() is None else 5.0),
              f"{side}: still running {STOP_S:.0f} s after SIGINT, or its group 5 s later (killed)")
    finally:
        stop_group(proc.pid, grace_s=0)
        proc.wait()


def load(port: int, bodies: Path, seconds: float, script: Path) -> dict[str, float]:
    proc = subprocess.run(["wrk", "-t2", f"-c{THREADS}", f"-d{seconds:g}s", f"--timeout={TIMEOUT_S:g}s", "-s",
                           str(script), f"http://127.0.0.1:{port}/predict"], capture_output=True, text=True,
                          env={**os.environ, "BODIES": str(bodies)}, timeout=seconds + TIMEOUT_S + 30)
    check(proc.returncode == 0, f"wrk exited {proc.returncode}: {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    check(got["failed"] == 0 and got["requests"] > 0, f"wrk: {got['failed']} of {got['requests']} requests failed or "
                                                      f"were not answered 2xx:\n{proc.stdout[-2000:]}")
    return {"p50": got["p50_us"] / 1000, "p99": got["p99_us"] / 1000,
            "rate": got["requests"] / (got["duration_us"] / 1e6)}


def run(config: Config, log: Callable[[str], None]) -> Result:
    seconds, repeats = 5.0 if config.quick else 30.0, config.reps(full=3, quick=1)
    with scratch("serve") as folder:
        root, env = trained_reference(folder, log, NAME)
        features = list(json.loads((root / "data/processed/stats.json").read_text())["features"])
        raw = pd.read_parquet(root / "data/raw").drop(columns=["target"])
        rows = [dict(zip(features, map(float, v), strict=True)) for v in raw[features].to_numpy("float64")]
        rng = np.random.default_rng(20)
        fixed = [rows[int(i)] for i in rng.choice(len(rows), WARMUP, replace=False)]
        model, scorer, score = load_model(root)  # tasks.predict's own scores: each fixed row alone, then together
        expected = {"single": [float(score(scorer, pd.DataFrame([r], columns=model))[0]) for r in fixed],
                    "batch": [float(s) for s in score(scorer, pd.DataFrame(fixed, columns=model))]}
        bodies, script = folder / "bodies.jsonl", folder / "load.lua"  # a draw with replacement, for both sides
        bodies.write_text("".join(json.dumps({"rows": [rows[int(i)]]}) + "\n"
                                  for i in rng.integers(0, len(rows), 10 * len(rows))))
        script.write_text(WRK)
        with (serving("bare", [sys.executable, str(Path(__file__).with_name("plain.py")), "serve", str(root), "0"],
                      root, env, folder / "bare.log") as bare,
              serving("conveyor", ["conveyor", "serve-model", "--port", "0"], root, env,
                      folder / "conveyor.log") as conveyor):
            version, (status, card), (_, health) = conveyor["version"], *(call(conveyor["port"], p)
                                                                          for p in ("/model", "/health"))
            check(status == 200 and card.get("version") == version and card.get("features") == features
                  and health.get("model") == version, f"conveyor: GET /model answered {status} {str(card)[:300]}, "
                  f"GET /health {health}, not version {version} with stats.json's features in order")
            for server in (bare, conveyor):
                for sent, want in [*(([r], [s]) for r, s in zip(fixed, expected["single"], strict=True)),
                                   (fixed, expected["batch"])]:
                    status, answer = call(server["port"], "/predict", {"rows": sent})
                    check(status == 200 and len(answer.get("scores", [])) == len(sent) and answer.get("model") ==
                          server["version"] and bool(np.allclose(answer["scores"], want, rtol=RTOL, atol=0)),
                          f"{server['side']}: {len(sent)} fixed row(s): {status} {str(answer)[:300]}, not {want} "
                          f"(tasks.predict.score, relative {RTOL:g}) from model {server['version']}")
            base, cand = interleaved(repeats, lambda _i: load(bare["port"], bodies, seconds, script),
                                     lambda _i: load(conveyor["port"], bodies, seconds, script), log)
    return Result(NAME, DESCRIPTION, "`python plain.py serve`: FastAPI + pydantic, the project's load/score, uvicorn's "
                  "defaults", "`conveyor serve-model --port 0` (per-version validation, body limit, version in every "
                  "answer)", repeats, [*(Metric(f"{k} latency (ms), 1-row requests", [f[k] for f in base],
                                               [f[k] for f in cand]) for k in ("p50", "p99")),
                                       Metric("throughput (requests/s)", [f["rate"] for f in base],
                                              [f["rate"] for f in cand], ratio="candidate/baseline", digits=1)],
                  setup={"start-up (command to GET /health 200)": f"bare {bare['startup_s']:.1f} s, conveyor "
                                                                  f"{conveyor['startup_s']:.1f} s"})
