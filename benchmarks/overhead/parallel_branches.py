"""parallel-branches: `conveyor run` of two independent branches vs the same stages one after another.

A toy project (its own task package and two specs) in a temporary directory::

    left1 -> left2 -> left3 --+
                              +--> join
    right1 -> right2 -> right3 +

Each stage sleeps (the simulated work: waiting on a service, a GPU, a queue) and writes a
hash of its inputs. The candidate is ``conveyor run --force`` of that DAG; the baseline is
``conveyor run --force`` of the same stages with ``needs:`` chaining every stage to the
previous one, so that exactly one runs at a time, through the same runner, Prefect server
and process start-up: the ratio isolates what running branches at once buys. Both run
against one `prefect server start` (started here, before any measurement).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import tempfile
import textwrap
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import run_record, server_env, timed_cli

NAME = "parallel-branches"
DESCRIPTION = "conveyor run of a DAG with two independent branches of wait-heavy stages"
BRANCH = 3  # stages per branch
BRANCHES = ("left", "right")
STAGES = [f"{side}{i}" for side in BRANCHES for i in range(1, BRANCH + 1)] + ["join"]

STEPS = '''
"""Stages of the parallel-branches benchmark: sleep (the simulated work), then hash the inputs."""

import hashlib
import time


def step(ctx):
    work = ctx.params["work"]
    time.sleep(float(work["join_s" if ctx.stage == "join" else "sleep_s"]))
    digest = hashlib.sha256(ctx.stage.encode())
    for declared in sorted(work["deps"].get(ctx.stage, [])):  # its own deps: ctx.deps also holds what it needs
        digest.update(ctx.deps[declared].read_bytes())
    for path in ctx.outs.values():
        path.write_text(digest.hexdigest())
'''


def _out(stage: str) -> str:
    return f"out/{stage}.txt"


def _deps(stage: str) -> list[str]:
    if stage == "join":
        return [_out(f"{side}{BRANCH}") for side in BRANCHES]
    index = int(stage[-1])
    return [_out(f"{stage[:-1]}{index - 1}")] if index > 1 else []


def spec(name: str, *, chained: bool) -> str:
    """The pipeline spec; ``chained``: every stage ``needs`` the one before it in STAGES."""
    lines = [f"pipeline: {name}", "task_packages: [benchtasks]", "stages:"]
    for i, stage in enumerate(STAGES):
        needs = f", needs: [{STAGES[i - 1]}]" if chained and i > 0 else ""
        lines.append(f"  {stage}: {{task: benchtasks.steps:step, params: [work], deps: {json.dumps(_deps(stage))}, "
                     f"outs: [{_out(stage)}]{needs}}}")
    return "\n".join(lines) + "\n"


def expected_join() -> str:
    """What out/join.txt must hold: the hash chain of STEPS, computed here."""
    outs: dict[str, str] = {}
    for stage in STAGES:
        digest = hashlib.sha256(stage.encode())
        for dep in sorted(_deps(stage)):
            digest.update(outs[dep].encode())
        outs[_out(stage)] = digest.hexdigest()
    return outs[_out("join")]


def make_project(root: Path, sleep_s: float, join_s: float) -> None:
    (root / "benchtasks").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'bench-parallel-branches'\n")
    deps = json.dumps({stage: _deps(stage) for stage in STAGES})
    (root / "params.yaml").write_text(f"work: {{sleep_s: {sleep_s}, join_s: {join_s}, deps: {deps}}}\n")
    (root / "benchtasks" / "__init__.py").write_text("")
    (root / "benchtasks" / "steps.py").write_text(textwrap.dedent(STEPS).lstrip())
    (root / "configs" / "parallel.yaml").write_text(spec("branches", chained=False))
    (root / "configs" / "chained.yaml").write_text(spec("branches-chained", chained=True))


def _interval(stage: dict[str, Any]) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(stage["started"]), datetime.fromisoformat(stage["finished"])


def run(config: Config, log: Callable[[str], None]) -> Result:
    sleep_s, join_s = (0.5, 0.2) if config.quick else (1.0, 0.25)
    repeats = config.reps(full=3, quick=1)
    want = expected_join()
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-branches-"))
    make_project(root, sleep_s, join_s)
    wall = Metric("wall time of the `conveyor run` process (s)")
    flow_wall = Metric("run record wall_s (s)")
    speedup = Metric("run record speedup (stage_sum_s / wall_s)", ratio="candidate/baseline")
    critical = Metric("run record critical_path_s (s)")
    overheads: list[float] = []
    try:
        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            log(f"{NAME}: prefect server up in {server.startup_s:.1f} s on {server.url}")

            def conveyor_run(spec_name: str, *, chained: bool) -> dict[str, Any]:
                shutil.rmtree(root / "out", ignore_errors=True)
                args = ["conveyor", "run", "-c", f"configs/{spec_name}.yaml", "--force"]
                seconds = timed_cli(args, root, server_env(server)).seconds
                record = run_record(root)
                stages = record["stages"]
                check(record["status"] == "succeeded" and sorted(stages) == sorted(STAGES)
                      and all(s["status"] == "succeeded" for s in stages.values()),
                      f"{spec_name}: not every stage ran: { {n: s['status'] for n, s in stages.items()} }")
                got = (root / _out("join")).read_text()
                check(got == want, f"{spec_name}: out/join.txt is {got!r}, expected {want!r}")
                left = [_interval(stages[f"left{i}"]) for i in range(1, BRANCH + 1)]
                right = [_interval(stages[f"right{i}"]) for i in range(1, BRANCH + 1)]
                overlap = left[0][0] < right[-1][1] and right[0][0] < left[-1][1]
                if chained:
                    ordered = [_interval(stages[s]) for s in STAGES]
                    check(all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)),
                          "chained: two stages overlapped; the baseline must run one at a time")
                else:
                    check(overlap, "parallel: the two branches did not overlap")
                overheads.extend(s["duration_s"] - (join_s if n == "join" else sleep_s) for n, s in stages.items())
                return {"wall": seconds, "record": record}

            if not config.quick:
                log(f"{NAME}: warm-up (one run, not counted)")
                conveyor_run("parallel", chained=False)
                overheads.clear()
            log(f"{NAME}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, lambda _i: conveyor_run("chained", chained=True),
                                     lambda _i: conveyor_run("parallel", chained=False), log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall.baseline, wall.candidate = [r["wall"] for r in base], [r["wall"] for r in cand]
    for metric, key in ((flow_wall, "wall_s"), (speedup, "speedup"), (critical, "critical_path_s")):
        metric.baseline = [float(r["record"][key]) for r in base]
        metric.candidate = [float(r["record"][key]) for r in cand]
    ideal_sum = BRANCH * len(BRANCHES) * sleep_s + join_s
    ideal_cp = BRANCH * sleep_s + join_s
    bound = [c["record"]["wall_s"] / c["record"]["critical_path_s"] for c in cand]
    overheads.sort()
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`conveyor run --force` of the same stages with `needs:` chaining each to the previous one "
                 "(one at a time)",
        candidate="`conveyor run --force` of the DAG (the two branches at once)",
        repeats=repeats, metrics=[wall, flow_wall, speedup, critical],
        setup={"sleeps": f"{sleep_s} s a branch stage, {join_s} s the join",
               "ideal": f"stage sum {ideal_sum:.2f} s, critical path {ideal_cp:.2f} s, so a speedup bound of "
                        f"{ideal_sum / ideal_cp:.2f}x",
               "prefect server start": f"up in {server.startup_s:.1f} s before the first measurement",
               "warm-up": "none (--quick)" if config.quick else "one run of the DAG spec, not counted"},
        checks=["every run exited 0 with every stage `succeeded` (forced, none skipped), and out/join.txt the hash "
                "chain computed here",
                "in the candidate the two branches overlapped in time; in the baseline no two stages overlapped"],
        notes=[f"candidate wall_s / critical_path_s: median {sorted(bound)[len(bound) // 2]:.2f} "
               "(1.00 would be the Amdahl bound reached)",
               f"per-stage overhead (duration_s minus the sleep): median {overheads[len(overheads) // 2]:.3f} s, "
               f"max {overheads[-1]:.3f} s",
               "the process wall time includes interpreter start, imports and flow-run creation (the same on "
               "both sides), so its ratio is below the run record's"],
    )
