"""parallel-branches: `conveyor run` of two independent branches vs the same stages one after another.

left1 -> left2 -> left3 and right1 -> right2 -> right3 into ``join``, each stage a sleep and a hash of its inputs,
vs the same stages chained by ``needs:`` (one `prefect server start`). Checked: every stage ran, out/join.txt is the
hash chain computed here, the branches overlapped in the candidate and no two stages did in the baseline.
"""

import hashlib
import itertools
import json
import shutil
from collections.abc import Callable
from datetime import datetime
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved, scratch
from benchmarks.processes import PrefectServer
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
SPECS = {f"configs/{name}.yaml": "\n".join([f"pipeline: branches{'-chained' * chained}", "task_packages: [benchtasks]",
    "stages:", *(f"  {s}: {{task: benchtasks.steps:step, params: [work], deps: {json.dumps(DEPS[s])}, outs: "
                 f"[out/{s}.txt]" + (f", needs: [{STAGES[i - 1]}]}}" if chained and i else "}")
                 for i, s in enumerate(STAGES))]) + "\n"
    for name, chained in (("parallel", False), ("chained", True))}  # chained: each stage `needs` the one before


def expected_join() -> str:
    outs: dict[str, str] = {}
    for s in STAGES:
        outs[f"out/{s}.txt"] = hashlib.sha256((s + "".join(outs[d] for d in sorted(DEPS[s]))).encode()).hexdigest()
    return outs["out/join.txt"]


def run(config: Config, log: Callable[[str], None]) -> Result:
    sleep_s, join_s = (0.5, 0.2) if config.quick else (1.0, 0.25)
    repeats, want = config.reps(full=3, quick=1), expected_join()
    with scratch(NAME) as root, PrefectServer() as server:
        for rel, text in {"pyproject.toml": "[project]\nname = 'bench-parallel-branches'\n",
                          "params.yaml": f"work: {{sleep_s: {sleep_s}, join_s: {join_s}, deps: {json.dumps(DEPS)}}}\n",
                          "benchtasks/__init__.py": "", "benchtasks/steps.py": STEPS, **SPECS}.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)

        def conveyor_run(chained: bool) -> dict[str, Any]:
            name = "chained" if chained else "parallel"
            shutil.rmtree(root / "out", ignore_errors=True)
            seconds = timed_cli(["conveyor", "run", "-c", f"configs/{name}.yaml", "--force"], root,
                                server_env(server)).seconds
            check_record(record := run_record(root), STAGES, "succeeded", name)
            got = (root / "out/join.txt").read_text()
            check(got == want, f"{name}: out/join.txt is {got!r}, expected {want!r}")
            span = {s: [datetime.fromisoformat(t[k]) for k in ("started", "finished")]
                    for s, t in record["stages"].items()}
            check(all(span[a][1] <= span[b][0] for a, b in itertools.pairwise(STAGES)) if chained else
                  span["left1"][0] < span[f"right{BRANCH}"][1] and span["right1"][0] < span[f"left{BRANCH}"][1],
                  f"{name}: two stages overlapped" if chained else "parallel: the two branches did not overlap")
            return {**record, "wall": seconds}
        if not config.quick:
            conveyor_run(False)
        log(f"{NAME}: {repeats} interleaved repetitions")
        base, cand = interleaved(repeats, lambda _i: conveyor_run(True), lambda _i: conveyor_run(False), log)
    metrics = [Metric(label, [float(r[key]) for r in base], [float(r[key]) for r in cand],
                      ratio="candidate/baseline" if key == "speedup" else "baseline/candidate")
               for label, key in (("wall time of the `conveyor run` process (s)", "wall"),
                                  ("run record wall_s (s)", "wall_s"), ("run record speedup (stage_sum_s / wall_s)",
                                  "speedup"), ("run record critical_path_s (s)", "critical_path_s"))]
    bound = (BRANCH * len(BRANCHES) * sleep_s + join_s) / (BRANCH * sleep_s + join_s)
    return Result(NAME, DESCRIPTION, "`conveyor run --force` of the stages chained by `needs:` (one at a time)",
                  "`conveyor run --force` of the DAG (the two branches at once)", repeats, metrics,
                  setup={"prefect server start": f"up in {server.startup_s:.1f} s",
                         "speedup bound (stage sum / critical path, the sleeps alone)": f"{bound:.2f}x"})
