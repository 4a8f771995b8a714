"""chain: what each stage that runs costs: 50 trivial chained steps (10 with --quick), done four ways.

``s<k>`` appends its name to ``out/s<k-1>.txt``'s text in ``out/s<k>.txt``; rows 1-5 on one `prefect server start`,
row 6 with no PREFECT_API_URL; one stage more costs ``(T(50) - T(1)) / 49``. Checked: every run (in a fresh copy) left
the same outs and nothing else; dvc.lock and the run record list every stage.
"""

from collections.abc import Callable, Mapping
from datetime import datetime

import yaml

from benchmarks import projects
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.overhead.noop import CLI_GOAL_S, dvc_chain
from benchmarks.processes import PrefectServer
from benchmarks.projects import Copies, chain_text, check_record, make_repo, out, per_stage_ms, stage

NAME = "chain"
DESCRIPTION = "50 trivial chained steps: conveyor run --force vs a plain loop, a bare Prefect flow, dvc repro -f"
STAGE_GOAL_MS, PREFECT_GOAL, DVC_GOAL = 20.0, 1.5, 1.0  # per stage that runs; x the bare flow; x dvc repro -f
IN_FLOW = "seconds in the flow: "  # what the bare flow prints: the span of its task loop
COLD = ("bare-flow-temporary-server", "conveyor-embedded-server")
SIDES = {"loop": ("plain", "python loop.py {n}"), "bare": ("plain", "python bare_flow.py {n}"),  # template, command
         "dvc": ("dvc-{n}", "dvc repro -f"), "conveyor": ("conveyor", "conveyor run -c configs/chain{n}.yaml --force")}
STEPS = '''\
from pathlib import Path
def write(stage, prev, out):
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text((Path(prev).read_text() if prev is not None else "") + f"{stage}\\n")
def by_index(k):  # the loop, the bare Prefect flow, dvc's python -c
    write(f"s{k:02d}", f"out/s{k - 1:02d}.txt" if k else None, f"out/s{k:02d}.txt")
def step(ctx):  # the conveyor task: its one dep (none for the first) into its one out
    write(ctx.stage, next(iter(ctx.deps.values()), None), *ctx.outs.values())
'''
LOOP = "import sys\nfrom steps.chain import by_index\nfor k in range(int(sys.argv[1])):\n    by_index(k)\n"
BARE_FLOW = '''\
import sys, time
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from steps.chain import by_index
step = task(by_index, name="step", cache_policy=NO_CACHE, persist_result=False)
@flow(name="chain", persist_result=False)
def chain(n):
    started = time.perf_counter()
    for k in range(n):
        step.submit(k).result()
    return time.perf_counter() - started
if __name__ == "__main__":
    print(f"''' + IN_FLOW + '''{chain(int(sys.argv[1])):.6f}")
'''


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, repeats, cold_repeats = (10, config.reps(5, 2), 1) if config.quick else (50, config.reps(5, 2), 2)
    inside: dict[str, list[float]] = {}  # seconds in the flow
    with scratch(NAME) as tmp:
        (home := tmp / "prefect-home-embedded").mkdir()
        copies, cold_env = Copies(tmp), projects.no_server_env(home)

        def go(side: str, size: int, env: Mapping[str, str]) -> float:
            template, command = SIDES[kind := side.split("-")[0]]
            with copies.fresh(tmp / template.format(n=size), side) as workdir:
                done = projects.timed_cli(command.format(n=size).split(), workdir, env, strict=side != COLD[0])
                got = {p.name: p.read_text() for p in (workdir / "out").iterdir() if p.name != ".gitignore"}  # DVC's
                check(got == {f"{stage(k)}.txt": chain_text(k) for k in range(size)}, f"{side}: out/ not as expected")
                if kind == "bare":
                    lines = [line for line in done.stdout.splitlines() if line.startswith(IN_FLOW)]
                    check(len(lines) == 1, f"{side}: the flow did not print {IN_FLOW!r}:\n{done.stdout[-2000:]}")
                    inside.setdefault(f"{side}{size}", []).append(float(lines[0].removeprefix(IN_FLOW)))
                elif kind == "dvc":
                    lock = yaml.safe_load((workdir / "dvc.lock").read_text()).get("stages", {})
                    check(sorted(lock) == [stage(k) for k in range(size)], f"{side}: dvc.lock lacks stages: {lock}")
                elif kind == "conveyor":
                    record = projects.run_record(workdir)
                    check_record(record, [stage(k) for k in range(size)], "succeeded", side)
                    started, finished = (datetime.fromisoformat(record[k]) for k in ("started", "finished"))
                    inside.setdefault(f"{side}{size}", []).append((finished - started).total_seconds())
                    if "PREFECT_API_URL" not in env:
                        projects.check_no_leftovers(home, "conveyor run with its embedded server")
                return done.seconds
        steps = {"steps/__init__.py": "", "steps/chain.py": STEPS}
        make_repo(tmp / "plain", {**steps, "loop.py": LOOP, "bare_flow.py": BARE_FLOW}, dvc=False)
        for size in (n, 1):
            make_repo(tmp / f"dvc-{size}", {**steps, "dvc.yaml": dvc_chain(
                size, lambda k: f"python -c \"import steps.chain as c; c.by_index({k})\"")}, dvc=True)
        make_repo(tmp / "conveyor", {**steps, "pyproject.toml": '[project]\nname = "chain"\nversion = "0"\n',
                                     "params.yaml": "# the chain has no params\n{}\n",
                                     **{f"configs/chain{size}.yaml": f"pipeline: chain{size}\ntask_packages: [steps]\n"
                                        "stages:\n" + "".join(f"  {stage(k)}: {{task: steps.chain:step, " + (
                                            f"deps: [{out(k - 1)}], " if k else "") + f"outs: [{out(k)}]}}\n"
                                            for k in range(size)) for size in (n, 1)}}, dvc=False)
        with PrefectServer() as server:
            env, startup_s = projects.server_env(server), server.startup_s
            log(f"{NAME}: warm-up on the server up in {startup_s:.1f} s (one run of each side, not counted)")
            for side, size in (("loop", n), ("bare-flow", n), ("dvc", 1), ("conveyor", n)):
                go(side, size, env)
            inside.clear()
            base, cand = interleaved(repeats, lambda _i: {f"{side}{size}": go(side, size, env) for side, size in (
                ("loop", n), ("bare-flow", n), ("bare-flow", 1), ("dvc", n), ("dvc", 1))},
                lambda _i: {f"conveyor{size}": go("conveyor", size, env) for size in (n, 1)}, log)
        for side in COLD:
            go(side, 1, cold_env)
        cold = interleaved(cold_repeats, lambda _i: go(COLD[0], n, cold_env), lambda _i: go(COLD[1], n, cold_env), log)
    col = {key: [row[key] for row in rows] for rows in (base, cand) for key in rows[0]}
    vs_loop, vs_bare, vs_dvc = (Metric(f"{n} steps, wall (s), vs {what}; goal: {goal}", col[key], col[f"conveyor{n}"])
                                for key, what, goal in (
        (f"loop{n}", "plain Python loop", f"<= loop + {CLI_GOAL_S:g} s + {STAGE_GOAL_MS:g} ms/step"),
        (f"bare-flow{n}", "bare Prefect flow", f"<= {PREFECT_GOAL:g}x, ratio >= {1 / PREFECT_GOAL:.2f}"),
        (f"dvc{n}", "dvc repro -f", f"<= {DVC_GOAL:g}x, ratio >= {1 / DVC_GOAL:.2f}")))
    slopes = [per_stage_ms(d[f"{s}{n}"], d[f"{s}1"], n - 1) for d in (col, inside) for s in ("bare-flow", "conveyor")]
    per, in_flow = (Metric(f"per stage {what} (ms), ({t}({n})-{t}(1))/{n - 1}, vs Prefect task; goal: <= "
                           f"{STAGE_GOAL_MS:g} ms", slopes[i], slopes[i + 1], digits=1)
                    for i, what, t in ((0, "that runs", "T"), (2, "in the flow", "F")))
    emb = Metric(f"{n} steps, wall (s), no server running, vs bare Prefect flow; goal: <= {PREFECT_GOAL:g}x", *cold)
    loop_s = median(vs_loop.baseline) + CLI_GOAL_S + n * STAGE_GOAL_MS / 1000
    absolute = (vs_loop, per, in_flow)  # goals on conveyor's own figure (s, ms), the others on the ratio
    verdicts = [(x, median(x.candidate) if x in absolute else x.share(), goal) for x, goal in (
        (vs_loop, loop_s), (vs_bare, PREFECT_GOAL), (vs_dvc, DVC_GOAL), (per, STAGE_GOAL_MS), (in_flow, STAGE_GOAL_MS),
        (emb, PREFECT_GOAL))]
    return Result(
        NAME, DESCRIPTION, f"the {n} steps as a plain Python loop, a bare Prefect flow of {n} tasks, `dvc repro -f` "
        "(cmd stages)", f"`conveyor run --force` of a spec of {n} task stages (steps.chain:step)", repeats,
        [vs_loop, vs_bare, vs_dvc, per, in_flow, emb], setup={"prefect server start": f"up in {startup_s:.1f} s"},
        notes=[f"{x.label.split(';')[0]}: conveyor {fig:.2f}{'' if x in absolute else 'x'}, goal <= {goal:.2f}: "
               f"{met(fig <= goal)}" for x, fig, goal in verdicts])
