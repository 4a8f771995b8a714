"""noop: what "nothing to do" costs: a no-op `conveyor run` vs a no-op `dvc repro` in the same project.

dvc.yaml chains of 51, 1 and 201 stages (10 with ``--quick``; a skipped stage costs ``(T(201) - T(1)) / 200``) and,
not with ``--quick``, the reference project, up to date; then the CLI's start-up. Checked after every run: `dvc status`
clean, dvc.lock unchanged, a new run record with every stage skipped, nothing left running.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks import projects
from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.overhead.reference import make_template
from benchmarks.processes import PrefectServer
from benchmarks.projects import chain_text, check_record, cli, make_repo, no_server_env, out, per_stage_ms, stage

NAME = "noop"
DESCRIPTION = ("nothing to do: no-op conveyor run vs no-op dvc repro (chains of 51, 1 and 201 stages, the "
               "reference project); CLI start-up")
UP_TO_DATE = "Data and pipelines are up to date."
NOOP_GOAL, SKIP_GOAL_MS, CLI_GOAL_S = 1.5, 2.0, 0.5  # x dvc repro; per skipped stage; conveyor --help, validate
GOAL = f"goal: <= {NOOP_GOAL:g}x, ratio >= {1 / NOOP_GOAL:.2f}"


def dvc_chain(n: int, cmd: Callable[[int], str]) -> str:
    """A dvc.yaml of ``n`` cmd stages in a chain: ``s<k>`` runs ``cmd(k)``, deps the previous out, outs its own."""
    return "stages:\n" + "".join(f"  {stage(k)}:\n    cmd: {cmd(k)}\n" + (f"    deps: [{out(k - 1)}]\n" if k else "")
                                 + f"    outs: [{out(k)}]\n" for k in range(n))


@dataclass
class Idle:
    """An up-to-date project (checked as it is, then one no-op of each side not counted) whose no-ops are timed."""

    root: Path
    stages: list[str]
    env: dict[str, str]
    lock: bytes = b""
    run_id: str | None = None

    def __post_init__(self) -> None:
        self.unchanged("the run that brought it up to date")
        self.noop("dvc"), self.noop("conveyor")

    def unchanged(self, what: str) -> None:
        status = cli(["dvc", "status"], self.root, self.env).stdout
        check(UP_TO_DATE in status, f"{self.root.name}: `dvc status` after {what} is not clean:\n{status[-3000:]}")
        lock = (self.root / "dvc.lock").read_bytes()
        check(lock == (self.lock or lock), f"{self.root.name}: {what} changed dvc.lock")
        self.lock = lock

    def noop(self, tool: str) -> float:
        done = projects.timed_cli(["dvc", "repro"] if tool == "dvc" else ["conveyor", "run"], self.root, self.env)
        what = f"{self.root.name}: no-op `{tool}`"
        if tool == "dvc":
            check(UP_TO_DATE in done.stdout, f"{what} said:\n{done.stdout[-3000:]}")
        else:
            record = projects.run_record(self.root)
            check(record.get("run_id") != self.run_id, f"{what} wrote no new run record")
            self.run_id = record.get("run_id")
            check_record(record, self.stages, "skipped", what)
            projects.check_no_leftovers(Path(self.env["PREFECT_HOME"]), what)
        self.unchanged(what)
        return done.seconds


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, slope_n = (10, 10) if config.quick else (51, 201)  # per skipped stage: (T(slope_n) - T(1)) / (slope_n - 1)
    repeats, chains = config.reps(full=5, quick=2), dict[int, Idle]()
    with scratch(NAME) as tmp:
        (tmp / "prefect-home").mkdir()
        env, ref = no_server_env(tmp / "prefect-home"), tmp / "reference"
        for size in dict.fromkeys((n, 1, slope_n)):
            make_repo(root := tmp / f"chain-{size}", {"dvc.yaml": dvc_chain(size, lambda k: f"(cat {out(k - 1)}; echo "
                      f"{stage(k)}) > {out(k)}" if k else f"mkdir -p out && echo {stage(k)} > {out(k)}")}, dvc=True)
            cli(["dvc", "repro"], root, env)
            wrong = [out(k) for k in range(size) if (root / out(k)).read_text() != chain_text(k)]
            check(not wrong, f"{root.name}: outs missing or wrong after `dvc repro`: {wrong}")
            chains[size] = Idle(root, [stage(k) for k in range(size)], env)
        base, cand = interleaved(repeats, lambda _i: {k: c.noop("dvc") for k, c in chains.items()},
                                 lambda _i: {k: c.noop("conveyor") for k, c in chains.items()}, log)
        metrics = [Metric(f"no-op run, {'1 stage' if k == 1 else f'{k}-stage chain'} (s)" + (f"; {GOAL}" if k in (n, 1)
                          else ""), [b[k] for b in base], [c[k] for c in cand]) for k in chains]
        ms = [per_stage_ms([r[slope_n] for r in rows], [r[1] for r in rows], slope_n - 1) for rows in (base, cand)]
        metrics.append(Metric(f"per skipped stage (ms), (T({slope_n})-T(1))/{slope_n - 1}; goal: <= "
                              f"{SKIP_GOAL_MS:g} ms", ms[0], ms[1], digits=1))
        make_template(ref)
        if not config.quick:
            log(f"{NAME}: reference: first `conveyor run` (trains the models; not measured) on a prefect server")
            with PrefectServer() as server:
                projects.timed_cli(["conveyor", "run"], ref, projects.server_env(server), timeout=1800)
            stages = list(yaml.safe_load((ref / "dvc.yaml").read_text())["stages"])
            check_record(projects.run_record(ref), stages, "succeeded", "reference project, first run")
            idle = Idle(ref, stages, env)
            metrics.append(Metric(f"no-op run, reference project, {len(stages)} stages (s); {GOAL}", *interleaved(
                repeats, lambda _i: idle.noop("dvc"), lambda _i: idle.noop("conveyor"), log)))
        for dvc_args, args in (("dvc --help", "conveyor --help"), ("dvc status", "conveyor validate")):
            metrics.append(Metric(f"`{args}` vs `{dvc_args}` (s); goal: <= {CLI_GOAL_S:g} s",
                                  *alternating(dvc_args.split(), args.split(), ref, env, repeats)))
    verdicts = [(m, m.share(), "x", NOOP_GOAL) if GOAL in m.label else (m, median(m.candidate), "", SKIP_GOAL_MS
                if m.digits == 1 else CLI_GOAL_S) for m in metrics if "goal" in m.label]
    return Result(NAME, DESCRIPTION, "no-op `dvc repro` (or `dvc --help`, `dvc status`) in the same up-to-date project",
                  "no-op `conveyor run` (or `conveyor --help`, `conveyor validate`) there, no Prefect server", repeats,
                  metrics, notes=[f"{m.label}: conveyor {f:.2f}{x}: {met(f <= goal)}" for m, f, x, goal in verdicts])
