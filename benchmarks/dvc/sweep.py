"""sweep: a 4-item matrix, `conveyor run` vs `dvc repro` of the dvc.yaml compiled from it.

The spec's ``fit`` stage is a ``matrix: {model: [lin, tree], depth: [2, 4]}`` of ``cmd`` items ``on`` a dask
profile of 2 single-threaded workers; each item fits a least-squares model by gradient descent in pure
Python for a fixed number of steps (about 9 s of a core; 1 s with ``--quick``). `conveyor compile` writes
the DVC ``matrix:`` stage `dvc repro` runs an item after another; `conveyor run` runs one per worker. Both
sides are forced in one project, alternating; after every run `dvc status` is clean and the items' outs are
the warm-up's byte for byte. The bound on the ratio is the cores the items get, less conveyor's fixed costs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, interleaved, median
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import check_record, cli, make_repo, run_record, server_env, timed_cli

NAME = "sweep"
DESCRIPTION = "a 4-item matrix of CPU-bound commands: conveyor run (one item per Dask worker) vs dvc repro"
ITEMS = ["fit@lin-2", "fit@lin-4", "fit@tree-2", "fit@tree-4"]
FIT = '''\
import json, random, sys
model, depth, out, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rng = random.Random(f"{model}-{depth}")
xs = [rng.random() for _ in range(200)]
ys = [3 * x + 1 + rng.gauss(0, 0.1) * depth for x in xs]
a = b = 0.0
for _ in range(steps):
    da = db = 0.0
    for x, y in zip(xs, ys):
        err = a * x + b - y
        da += err * x
        db += err
    a -= 0.1 * da / len(xs)
    b -= 0.1 * db / len(xs)
loss = sum((a * x + b - y) ** 2 for x, y in zip(xs, ys)) / len(xs)
json.dump({"loss": round(loss, 6), "a": round(a, 4), "b": round(b, 4)}, open(out, "w"))
'''
SPEC = """\
pipeline: sweep
profiles:
  cpu: {{kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}}
stages:
  fit:
    cmd: python fit.py ${{item.model}} ${{item.depth}} out/${{key}}.json {steps}
    on: cpu
    matrix: {{model: [lin, tree], depth: [2, 4]}}
    deps: [fit.py]
    metrics:
      - out/${{key}}.json
"""


def run(config: Config, log: Callable[[str], None]) -> Result:
    steps = 15_000 if config.quick else 200_000
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-sweep-"))
    root = scratch / "project"

    def outs() -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted((root / "out").glob("*.json"))}

    try:
        make_repo(root, {"fit.py": FIT, "configs/pipeline.yaml": SPEC.format(steps=steps),
                         "pyproject.toml": "[project]\nname = 'sweep'\n", "out/.keep": ""}, dvc=True)
        with PrefectServer() as server:
            env = server_env(server)
            cli(["conveyor", "compile"], root, env)
            log(f"{NAME}: warm-up: one conveyor run (not counted)")
            cli(["conveyor", "run"], root, env)
            reference = outs()
            check(len(reference) == len(ITEMS), f"the warm-up wrote {sorted(reference)}, not {len(ITEMS)} outs")

            def side(args: list[str]) -> Callable[[int], tuple[float, dict[str, Any]]]:
                def once(_i: int) -> tuple[float, dict[str, Any]]:
                    seconds = timed_cli(args, root, env).seconds
                    dvc_status(root, env, f"after `{' '.join(args)}`")
                    check(outs() == reference, f"`{' '.join(args)}` wrote other outs than the warm-up")
                    if args[0] != "conveyor":
                        return seconds, {}
                    record = run_record(root)
                    check_record(record, ITEMS, "succeeded", "conveyor run --force")
                    return seconds, record
                return once

            log(f"{NAME}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, side(["dvc", "repro", "-f"]), side(["conveyor", "run", "--force"]), log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    item_s = median([float(s["duration_s"]) for _, r in cand for s in r["stages"].values()])
    wall = Metric("wall of the command (s)", [s for s, _ in base], [s for s, _ in cand])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`dvc repro -f` of the compiled dvc.yaml (one item at a time)",
        candidate="`conveyor run --force` (items at once, one per Dask worker)",
        repeats=repeats, metrics=[wall],
        setup={"work": f"each item: pure-Python gradient descent, {steps} steps over 200 points",
               "cores": str(os.cpu_count())},
        checks=["every run exited 0, `dvc status` was clean after it and it wrote the warm-up's 4 outs byte for byte",
                "conveyor's run record: the 4 items succeeded"],
        notes=[f"an item took a median {item_s:.2f} s in conveyor's record (waiting for a free worker included); "
               f"conveyor's flow (its record's wall_s) a median {median([float(r['wall_s']) for _, r in cand]):.2f} s, "
               "the rest of its wall is start-up and shut-down (imports, the spec, DVC's status, the cluster)"],
    )
