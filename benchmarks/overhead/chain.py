"""chain: what each stage that runs costs: 50 trivial chained steps (10 with --quick), done four ways.

``s<k>`` writes ``out/s<k-1>.txt``'s text plus its name into ``out/s<k>.txt``, the same function on every side:
a plain Python loop; a bare Prefect flow of 50 tasks, each awaited in turn; `dvc repro -f` of 50 ``python -c``
cmd stages; `conveyor run --force` of 50 task stages. Every run is in a fresh copy of a pristine project;
rows 1-5 on one `prefect server start`, row 6 with no PREFECT_API_URL. 1-step runs give one stage more,
``(T(50) - T(1)) / 49``. Checked: every run left the same outs and nothing else; dvc.lock and the run record
list every stage. Goals: at most 20 ms per stage that runs; no slower than `dvc repro -f`; within 1.5x the
bare flow; within the loop's time plus a 0.5 s start plus 20 ms a stage.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks import projects
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.overhead.noop import CLI_GOAL_S, dvc_chain
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import Copies, chain_text, check_record, make_repo, out, per_stage_ms, stage

NAME = "chain"
DESCRIPTION = "50 trivial chained steps: conveyor run --force vs a plain loop, a bare Prefect flow, dvc repro -f"
STAGE_GOAL_MS, PREFECT_GOAL, DVC_GOAL = 20.0, 1.5, 1.0  # per stage that runs; x the bare flow; x dvc repro -f
IN_FLOW = "seconds in the flow: "  # what the bare flow prints: the span of its task loop

STEPS = '''\
from pathlib import Path

def write(stage, prev, out):
    text = Path(prev).read_text() if prev is not None else ""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(f"{text}{stage}\\n")

def by_index(k):  # the loop, the bare Prefect flow, dvc's python -c
    write(f"s{k:02d}", f"out/s{k - 1:02d}.txt" if k else None, f"out/s{k:02d}.txt")

def step(ctx):  # the conveyor task: its one dep (none for the first) into its one out
    (dest,) = ctx.outs.values()
    write(ctx.stage, next(iter(ctx.deps.values()), None), dest)
'''

LOOP = "import sys\n\nfrom steps.chain import by_index\n\nfor k in range(int(sys.argv[1])):\n    by_index(k)\n"

BARE_FLOW = '''\
import sys
import time
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from steps.chain import by_index

@task(cache_policy=NO_CACHE, persist_result=False)
def step(k):
    by_index(k)

@flow(name="chain", persist_result=False)
def chain(n):
    started = time.perf_counter()
    for k in range(n):
        step.submit(k).result()
    return time.perf_counter() - started

if __name__ == "__main__":
    print(f"''' + IN_FLOW + '''{chain(int(sys.argv[1])):.6f}")
'''


def conveyor_spec(n: int) -> str:
    return f"pipeline: chain{n}\ntask_packages: [steps]\nstages:\n" + "".join(
        f"  {stage(k)}: {{task: steps.chain:step, " + (f"deps: [{out(k - 1)}], " if k else "") + f"outs: [{out(k)}]}}\n"
        for k in range(n))


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, repeats, cold_repeats = (10, config.reps(5, 2), 1) if config.quick else (50, config.reps(5, 2), 2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-chain-"))
    tpl, copies, home = scratch / "templates", Copies(scratch), scratch / "prefect-home-embedded"
    phase: dict[tuple[str, int], list[tuple[float, float, float]]] = {}  # conveyor: before, in, after the flow
    inside: dict[tuple[str, int], list[float]] = {}  # seconds in the flow
    left: list[bool] = []  # runs of the bare flow whose temporary server outlived them (killed)

    def go(side: str, size: int, env: Mapping[str, str]) -> float:
        """One run of ``side`` with ``size`` steps in a fresh copy, its outs and its record checked."""
        kind = next(k for k in ("loop", "bare", "dvc", "conveyor") if side.startswith(k))
        template, args = {"loop": ("plain", ["python", "loop.py", str(size)]),
                          "bare": ("plain", ["python", "bare_flow.py", str(size)]),
                          "dvc": (f"dvc-{size}", ["dvc", "repro", "-f"]),
                          "conveyor": ("conveyor", ["conveyor", "run", "-c", f"configs/chain{size}.yaml", "--force"])
                          }[kind]
        with copies.fresh(tpl / template, side) as workdir:
            began = datetime.now(UTC)
            done = projects.timed_cli(args, workdir, env, strict=side != "bare-flow-temporary-server")
            left.append(done.left)
            wrong = [out(k) for k in range(size) if not (workdir / out(k)).is_file()
                     or (workdir / out(k)).read_text() != chain_text(k)]
            made = sorted(p.name for p in (workdir / "out").iterdir() if p.name != ".gitignore")  # DVC's, for its outs
            check(not wrong and len(made) == size, f"{side}: outs missing or not as expected: {wrong}; in out/: {made}")
            if kind == "bare":
                lines = [line for line in done.stdout.splitlines() if line.startswith(IN_FLOW)]
                check(len(lines) == 1, f"{side}: the flow did not print {IN_FLOW!r}:\n{done.stdout[-2000:]}")
                inside.setdefault((side, size), []).append(float(lines[0].removeprefix(IN_FLOW)))
            elif kind == "dvc":
                lock = yaml.safe_load((workdir / "dvc.lock").read_text())
                check(sorted(lock.get("stages", {})) == [stage(k) for k in range(size)],
                      f"{side}: dvc.lock does not record the {size} stages")
            elif kind == "conveyor":
                record = projects.run_record(workdir)
                check_record(record, [stage(k) for k in range(size)], "succeeded", side)
                phase.setdefault((side, size), []).append(projects.phases(record, began, done.seconds))
                inside.setdefault((side, size), []).append(phase[side, size][-1][1])
            return done.seconds

    try:
        steps = {"steps/__init__.py": "", "steps/chain.py": STEPS}
        make_repo(tpl / "plain", {**steps, "loop.py": LOOP, "bare_flow.py": BARE_FLOW}, dvc=False)
        for size in (n, 1):
            make_repo(tpl / f"dvc-{size}", {**steps, "dvc.yaml": dvc_chain(
                size, lambda k: f"python -c \"import steps.chain as c; c.by_index({k})\"")}, dvc=True)
        make_repo(tpl / "conveyor", {**steps, "pyproject.toml": '[project]\nname = "chain"\nversion = "0"\n',
                                     "params.yaml": "# the chain has no params\n{}\n",
                                     f"configs/chain{n}.yaml": conveyor_spec(n),
                                     "configs/chain1.yaml": conveyor_spec(1)}, dvc=False)
        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            env = projects.server_env(server)
            log(f"{NAME}: warm-up on the server up in {server.startup_s:.1f} s (one run of each side, not counted)")
            for side, size in (("loop", n), ("bare-flow", n), ("dvc", 1), ("conveyor", n)):
                go(side, size, env)
            phase.clear()
            inside.clear()
            log(f"{NAME}: {repeats} interleaved repetitions of {n} and 1 step(s), on the shared server")
            base, cand = interleaved(repeats, lambda _i: {f"{side}{size}": go(side, size, env) for side, size in (
                ("loop", n), ("bare-flow", n), ("bare-flow", 1), ("dvc", n), ("dvc", 1))},
                lambda _i: {f"conveyor{size}": go("conveyor", size, env) for size in (n, 1)}, log)
            startup_s = server.startup_s
        home.mkdir()
        cold_env = projects.no_server_env(home)

        def cold(side: str, size: int) -> float:
            seconds = go(side, size, cold_env)
            if side.startswith("conveyor"):
                projects.check_no_leftovers(home, "conveyor run with its embedded server")
            return seconds

        log(f"{NAME}: PREFECT_API_URL unset: warm-up (creates the temporary PREFECT_HOME's database, not counted)")
        for side in ("bare-flow-temporary-server", "conveyor-embedded-server"):
            cold(side, 1)
            phase.pop((side, 1), None)
            inside.pop((side, 1), None)
        log(f"{NAME}: {cold_repeats} interleaved repetitions, PREFECT_API_URL unset")
        cold_base, cold_cand = interleaved(cold_repeats, lambda _i: cold("bare-flow-temporary-server", n),
                                           lambda _i: cold("conveyor-embedded-server", n), log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    col = {key: [row[key] for row in rows] for rows in (base, cand) for key in rows[0]}
    conv, budget_s = col[f"conveyor{n}"], CLI_GOAL_S + n * STAGE_GOAL_MS / 1000
    m = {key: median(values) for key, values in col.items()}
    vs_loop, vs_bare, vs_dvc = (Metric(f"{n} steps, wall (s), vs {what}; goal: {goal}", col[key], conv)
                                for key, what, goal in (
        (f"loop{n}", "plain Python loop", f"<= loop + {CLI_GOAL_S:g} s + {STAGE_GOAL_MS:g} ms/step"),
        (f"bare-flow{n}", "bare Prefect flow", f"<= {PREFECT_GOAL:g}x, ratio >= {1 / PREFECT_GOAL:.2f}"),
        (f"dvc{n}", "dvc repro -f", f"<= {DVC_GOAL:g}x, ratio >= {1 / DVC_GOAL:.2f}")))
    per = Metric(f"per stage that runs (ms), (T({n})-T(1))/{n - 1}, vs Prefect task; goal: <= {STAGE_GOAL_MS:g} ms",
                 per_stage_ms(col[f"bare-flow{n}"], col["bare-flow1"], n - 1),
                 per_stage_ms(conv, col["conveyor1"], n - 1), digits=1)
    in_flow = Metric(f"per stage in the flow (ms), (F({n})-F(1))/{n - 1}, vs Prefect task; goal: <= "
                     f"{STAGE_GOAL_MS:g} ms", per_stage_ms(inside["bare-flow", n], inside["bare-flow", 1], n - 1),
                     per_stage_ms(inside["conveyor", n], inside["conveyor", 1], n - 1), digits=1)
    embedded = Metric(f"{n} steps, wall (s), no server running, vs bare Prefect flow; goal: <= {PREFECT_GOAL:g}x",
                      cold_base, cold_cand)
    dvc_per = median(per_stage_ms(col[f"dvc{n}"], col["dvc1"], n - 1))
    notes = [
        f"1 step (medians, s): bare Prefect flow {m['bare-flow1']:.2f}, dvc repro -f {m['dvc1']:.2f}, conveyor run "
        f"--force {m['conveyor1']:.2f}; dvc repro -f per stage that runs {dvc_per:.1f} ms",
        f"per stage that runs: goal conveyor <= {STAGE_GOAL_MS:g} ms: {met(median(per.candidate) <= STAGE_GOAL_MS)} "
        "(row 4's wall times carry a process's start and exit jitter; row 5 leaves them out)",
        f"vs the loop: goal conveyor <= loop + {CLI_GOAL_S:g} s start + {n} x {STAGE_GOAL_MS:g} ms = "
        f"{m[f'loop{n}'] + budget_s:.2f} s, i.e. ratio >= {m[f'loop{n}'] / (m[f'loop{n}'] + budget_s):.2f}: "
        f"{met(m[f'conveyor{n}'] <= m[f'loop{n}'] + budget_s)}",
        f"conveyor / the bare Prefect flow {vs_bare.share():.2f}x (goal <= {PREFECT_GOAL:g}x: "
        f"{met(vs_bare.share() <= PREFECT_GOAL)}), {embedded.share():.2f}x with no server running; conveyor / dvc "
        f"repro -f {vs_dvc.share():.2f}x (goal <= {DVC_GOAL:g}x: {met(vs_dvc.share() <= DVC_GOAL)})",
        f"row 5 (F: the bare flow's task loop, conveyor's run record started -> finished): F({n}) medians bare flow "
        f"{median(inside['bare-flow', n]):.2f} s, conveyor {median(inside['conveyor', n]):.2f} s; goal conveyor <= "
        f"{STAGE_GOAL_MS:g} ms: {met(median(in_flow.candidate) <= STAGE_GOAL_MS)}",
        *(projects.phases_note(f"`conveyor run --force` ({what}, {n} stages)", phase[side, n])
          for side, what in (("conveyor", "shared server"), ("conveyor-embedded-server", "embedded server"))
          if phase.get((side, n))),
        *([f"the bare Prefect flow left its temporary server running 10 s after it exited in {sum(left)} run(s) "
           "(killed before the next run)"] if any(left) else [])]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"the {n} steps as a plain Python loop, a bare Prefect flow of {n} tasks, `dvc repro -f` (cmd stages)",
        candidate=f"`conveyor run --force` of a spec of {n} task stages (steps.chain:step)",
        repeats=repeats, metrics=[vs_loop, vs_bare, vs_dvc, per, in_flow, embedded],
        setup={"prefect server start": f"up in {startup_s:.1f} s before the first measurement (rows 1-5)",
               "repetitions without a server (row 6)": str(len(cold_base))},
        checks=[f"every command exited 0; every run left the same out/s00.txt ... out/s{n - 1:02d}.txt, nothing else "
                "in out/ (DVC's .gitignore aside); dvc.lock and conveyor's run record (every stage succeeded) list "
                "every stage; no process of conveyor's embedded server outlived its run"],
        notes=notes,
    )
