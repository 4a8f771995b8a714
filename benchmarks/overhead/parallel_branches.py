"""parallel-branches: `conveyor run` of two independent branches vs the same stages one after another.

left1 -> left2 -> left3 and right1 -> right2 -> right3 into ``join``; each stage sleeps (a wait on a service,
a GPU, a queue) and writes a hash of its inputs. Candidate: ``conveyor run --force`` of that DAG; baseline:
the same stages chained by ``needs:``, through the same runner, `prefect server start` and start-up, so the
ratio isolates what running branches at once buys. Checked: every stage ran, out/join.txt is the hash chain
computed here, the branches overlapped in the candidate and no two stages did in the baseline.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved, median
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import check_record, run_record, server_env, timed_cli

NAME = "parallel-branches"
DESCRIPTION = "conveyor run of a DAG with two independent branches of wait-heavy stages"
BRANCH, BRANCHES = 3, ("left", "right")  # stages per branch
STAGES = [f"{side}{i}" for side in BRANCHES for i in range(1, BRANCH + 1)] + ["join"]
DEPS = {s: [f"out/{s[:-1]}{int(s[-1]) - 1}.txt"] if s[-1] > "1" else [] for s in STAGES[:-1]}
DEPS["join"] = [f"out/{side}{BRANCH}.txt" for side in BRANCHES]

STEPS = '''\
import hashlib
import time

def step(ctx):
    work = ctx.params["work"]
    time.sleep(float(work["join_s" if ctx.stage == "join" else "sleep_s"]))
    digest = hashlib.sha256(ctx.stage.encode())
    for declared in sorted(work["deps"][ctx.stage]):  # its own deps: ctx.deps also holds what it needs
        digest.update(ctx.deps[declared].read_bytes())
    for path in ctx.outs.values():
        path.write_text(digest.hexdigest())
'''


def spec(name: str, *, chained: bool) -> str:
    """The pipeline spec; ``chained``: every stage ``needs`` the one before it in STAGES."""
    return "\n".join([f"pipeline: {name}", "task_packages: [benchtasks]", "stages:", *(
        f"  {s}: {{task: benchtasks.steps:step, params: [work], deps: {json.dumps(DEPS[s])}, outs: [out/{s}.txt]"
        + (f", needs: [{STAGES[i - 1]}]}}" if chained and i else "}") for i, s in enumerate(STAGES))]) + "\n"


def expected_join() -> str:
    """What out/join.txt must hold: the hash chain of STEPS, computed here."""
    outs: dict[str, str] = {}
    for s in STAGES:
        digest = hashlib.sha256(s.encode())
        for dep in sorted(DEPS[s]):
            digest.update(outs[dep].encode())
        outs[f"out/{s}.txt"] = digest.hexdigest()
    return outs["out/join.txt"]


def _span(stage: dict[str, Any]) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(stage["started"]), datetime.fromisoformat(stage["finished"])


def run(config: Config, log: Callable[[str], None]) -> Result:
    sleep_s, join_s = (0.5, 0.2) if config.quick else (1.0, 0.25)
    repeats, want = config.reps(full=3, quick=1), expected_join()
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-branches-"))
    for rel, text in {"pyproject.toml": "[project]\nname = 'bench-parallel-branches'\n", "benchtasks/__init__.py": "",
                      "params.yaml": f"work: {{sleep_s: {sleep_s}, join_s: {join_s}, deps: {json.dumps(DEPS)}}}\n",
                      "benchtasks/steps.py": STEPS, "configs/parallel.yaml": spec("branches", chained=False),
                      "configs/chained.yaml": spec("branches-chained", chained=True)}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    overheads: list[float] = []
    try:
        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            log(f"{NAME}: prefect server up in {server.startup_s:.1f} s on {server.url}")

            def conveyor_run(chained: bool) -> dict[str, Any]:
                name = "chained" if chained else "parallel"
                shutil.rmtree(root / "out", ignore_errors=True)
                seconds = timed_cli(["conveyor", "run", "-c", f"configs/{name}.yaml", "--force"], root,
                                    server_env(server)).seconds
                record = run_record(root)
                stages = record["stages"]
                check_record(record, STAGES, "succeeded", name)
                got = (root / "out/join.txt").read_text()
                check(got == want, f"{name}: out/join.txt is {got!r}, expected {want!r}")
                left, right = ([_span(stages[f"{side}{i}"]) for i in range(1, BRANCH + 1)] for side in BRANCHES)
                if chained:
                    check(all(a[1] <= b[0] for a, b in itertools.pairwise(_span(stages[s]) for s in STAGES)),
                          "chained: two stages overlapped; the baseline must run one at a time")
                else:
                    check(left[0][0] < right[-1][1] and right[0][0] < left[-1][1],
                          "parallel: the two branches did not overlap")
                overheads.extend(s["duration_s"] - (join_s if n == "join" else sleep_s) for n, s in stages.items())
                return {**record, "wall": seconds}

            if not config.quick:
                log(f"{NAME}: warm-up (one run, not counted)")
                conveyor_run(False)
                overheads.clear()
            log(f"{NAME}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, lambda _i: conveyor_run(True), lambda _i: conveyor_run(False), log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    metrics = [Metric(label, [float(r[key]) for r in base], [float(r[key]) for r in cand],
                      ratio="candidate/baseline" if key == "speedup" else "baseline/candidate")
               for label, key in (("wall time of the `conveyor run` process (s)", "wall"),
                                  ("run record wall_s (s)", "wall_s"),
                                  ("run record speedup (stage_sum_s / wall_s)", "speedup"),
                                  ("run record critical_path_s (s)", "critical_path_s"))]
    bound = median([c["wall_s"] / c["critical_path_s"] for c in cand])
    ideal_sum, ideal_cp = BRANCH * len(BRANCHES) * sleep_s + join_s, BRANCH * sleep_s + join_s
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`conveyor run --force` of the stages chained by `needs:` (one at a time)",
        candidate="`conveyor run --force` of the DAG (the two branches at once)",
        repeats=repeats, metrics=metrics,
        setup={"sleeps": f"{sleep_s} s a branch stage, {join_s} s the join",
               "ideal": f"stage sum {ideal_sum:.2f} s, critical path {ideal_cp:.2f} s, so a speedup bound of "
                        f"{ideal_sum / ideal_cp:.2f}x",
               "prefect server start": f"up in {server.startup_s:.1f} s before the first measurement",
               "warm-up": "none (--quick)" if config.quick else "one run of the DAG spec, not counted"},
        checks=["every run exited 0, every stage `succeeded`, out/join.txt the hash chain computed here; the "
                "branches overlapped in the candidate, no two stages in the baseline"],
        notes=[f"candidate wall_s / critical_path_s: median {bound:.2f} (1.00 would be the Amdahl bound reached); "
               "per-stage overhead (duration_s minus the sleep): "
               f"median {median(overheads):.3f} s, max {max(overheads):.3f} s"],
    )
