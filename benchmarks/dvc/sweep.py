"""sweep: a 4-item matrix, `conveyor run` vs `dvc repro` of the dvc.yaml compiled from it.

``fit``'s ``matrix: {model: [lin, tree], depth: [2, 4]}`` of pure-Python gradient descents (about 9 s of a core each;
1 s ``--quick``) ``on`` a dask profile of 2 single-threaded workers; both sides forced in one project, alternating.
Checked: `dvc status` clean after every run, the warm-up's outs byte for byte, conveyor's record: 4 items succeeded."""

from collections.abc import Callable
from typing import Any

from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, scratch
from benchmarks.processes import PrefectServer
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
profiles: {{cpu: {{kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}}}}
stages:
  fit: {{cmd: "python fit.py ${{item.model}} ${{item.depth}} out/${{key}}.json {steps}", on: cpu,
        matrix: {{model: [lin, tree], depth: [2, 4]}}, deps: [fit.py], metrics: ["out/${{key}}.json"]}}
"""


def run(config: Config, log: Callable[[str], None]) -> Result:
    steps, repeats = 15_000 if config.quick else 200_000, config.reps(full=3, quick=1)
    with scratch(NAME) as folder, PrefectServer() as server:
        root, env = folder / "project", server_env(server)
        make_repo(root, {"fit.py": FIT, "configs/pipeline.yaml": SPEC.format(steps=steps),
                         "pyproject.toml": "[project]\nname = 'sweep'\n", "out/.keep": ""}, dvc=True)

        def outs() -> dict[str, str]:
            return {p.name: p.read_text() for p in sorted((root / "out").glob("*.json"))}
        cli(["conveyor", "compile"], root, env)
        cli(["conveyor", "run"], root, env)  # a warm-up, not counted
        check(len(reference := outs()) == len(ITEMS), f"the warm-up wrote {sorted(reference)}, not {len(ITEMS)} outs")

        def once(*args: str) -> tuple[float, dict[str, Any]]:
            seconds = timed_cli(args, root, env).seconds
            dvc_status(root, env, f"after `{' '.join(args)}`")
            check(outs() == reference, f"`{' '.join(args)}` wrote other outs than the warm-up")
            record = run_record(root) if args[0] == "conveyor" else {}
            if record:
                check_record(record, ITEMS, "succeeded", "conveyor run --force")
            return seconds, record
        base, cand = interleaved(repeats, lambda _i: once("dvc", "repro", "-f"),
                                 lambda _i: once("conveyor", "run", "--force"), log)
    item_s, flow_s = (median([float(s["duration_s"]) for _, r in cand for s in r["stages"].values()]),
                      median([float(r["wall_s"]) for _, r in cand]))
    return Result(NAME, DESCRIPTION, "`dvc repro -f` of the compiled dvc.yaml (one item at a time)",
                  "`conveyor run --force` (items at once, one per Dask worker)", repeats,
                  [Metric("wall of the command (s)", [s for s, _ in base], [s for s, _ in cand])],
                  setup={"steps per item": str(steps)}, notes=[f"an item took a median {item_s:.2f} s in conveyor's "
                  f"record (waiting for a free worker included); its flow (wall_s) a median {flow_s:.2f} s"])
