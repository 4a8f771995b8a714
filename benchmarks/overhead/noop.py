"""noop: what "nothing to do" costs: a no-op `conveyor run` vs a no-op `dvc repro` in the same project.

Up-to-date git + DVC projects, dvc.yaml chains of 51, 1 and 201 ``cmd`` stages (10 with ``--quick``) and
(not with ``--quick``) the reference project; interleaved no-op `dvc repro` and `conveyor run` (no
PREFECT_API_URL: a no-op needs no server). One skipped stage costs ``(T(201) - T(1)) / 200``. Checked after
every run: `dvc status` clean, dvc.lock unchanged, a new run record with every stage skipped, nothing left
running. Goals: within 1.5x `dvc repro`; at most 2 ms a skipped stage; `conveyor --help` and `conveyor
validate` under 0.5 s (beside `dvc --help`, `dvc status`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks import projects
from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.overhead.reference import make_template
from benchmarks.prefect_server import PrefectServer
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
    """An up-to-date project whose no-op runs are timed, then checked."""

    root: Path
    stages: list[str]
    home: Path  # PREFECT_HOME; no PREFECT_API_URL
    lock: bytes = b""
    run_id: str | None = None
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # conveyor: before/in/after the flow

    def unchanged(self, what: str) -> None:
        status = cli(["dvc", "status"], self.root, no_server_env(self.home)).stdout
        check(UP_TO_DATE in status, f"{self.root.name}: `dvc status` after {what} is not clean:\n{status[-3000:]}")
        lock = (self.root / "dvc.lock").read_bytes()
        check(lock == (self.lock or lock), f"{self.root.name}: {what} changed dvc.lock")
        self.lock = lock

    def dvc(self) -> float:
        done = projects.timed_cli(["dvc", "repro"], self.root, no_server_env(self.home))
        check(UP_TO_DATE in done.stdout, f"{self.root.name}: no-op `dvc repro` did not say {UP_TO_DATE!r}:\n"
                                         f"{done.stdout[-3000:]}")
        self.unchanged("a no-op `dvc repro`")
        return done.seconds

    def conveyor(self) -> float:
        began = datetime.now(UTC)
        seconds = projects.timed_cli(["conveyor", "run"], self.root, no_server_env(self.home)).seconds
        record = projects.run_record(self.root)
        check(record.get("run_id") != self.run_id, f"{self.root.name}: `conveyor run` wrote no new run record")
        self.run_id = record.get("run_id")
        check_record(record, self.stages, "skipped", f"{self.root.name}: no-op `conveyor run`")
        projects.check_no_leftovers(self.home, f"{self.root.name}: no-op `conveyor run`")
        self.unchanged("a no-op `conveyor run`")
        self.phases.append(projects.phases(record, began, seconds))
        return seconds

    def warmed(self) -> Idle:
        """One no-op of each side, not counted."""
        self.dvc()
        self.conveyor()
        self.phases.clear()
        return self


def _chain(root: Path, n: int, home: Path, log: Callable[[str], None]) -> Idle:
    make_repo(root, {"dvc.yaml": dvc_chain(n, lambda k: f"(cat {out(k - 1)}; echo {stage(k)}) > {out(k)}" if k
                                           else f"mkdir -p out && echo {stage(k)} > {out(k)}")}, dvc=True)
    log(f"{NAME}: {root.name}: `dvc repro` of {n} stage(s) to bring it up to date")
    cli(["dvc", "repro"], root, no_server_env(home))
    wrong = [out(k) for k in range(n) if (root / out(k)).read_text() != chain_text(k)]
    check(not wrong, f"{root.name}: outs missing or wrong after `dvc repro`: {wrong}")
    idle = Idle(root, [stage(k) for k in range(n)], home)
    idle.unchanged("bringing it up to date")
    return idle


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, slope_n = (10, 10) if config.quick else (51, 201)  # per skipped stage: (T(slope_n) - T(1)) / (slope_n - 1)
    repeats = config.reps(full=5, quick=2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-noop-"))
    home, ref = scratch / "prefect-home", scratch / "reference"
    home.mkdir()
    notes: list[str] = []
    try:
        chains = {size: _chain(scratch / f"chain-{size}", size, home, log).warmed() for size in dict.fromkeys(
            (n, 1, slope_n))}
        log(f"{NAME}: {repeats} interleaved repetitions: no-op dvc repro vs no-op conveyor run, {list(chains)} stages")
        base, cand = interleaved(repeats, lambda _i: {k: c.dvc() for k, c in chains.items()},
                                 lambda _i: {k: c.conveyor() for k, c in chains.items()}, log)
        metrics = [Metric(f"no-op run, {k}-stage chain (s); {GOAL}" if k == n else f"no-op run, 1 stage (s); {GOAL}"
                          if k == 1 else f"no-op run, {k}-stage chain (s)", [b[k] for b in base], [c[k] for c in cand])
                   for k in chains]
        ms = [per_stage_ms([r[slope_n] for r in rows], [r[1] for r in rows], slope_n - 1) for rows in (base, cand)]
        per = Metric(f"per skipped stage (ms), (T({slope_n})-T(1))/{slope_n - 1}; goal: <= {SKIP_GOAL_MS:g} ms",
                     ms[0], ms[1], digits=1)
        metrics.append(per)
        notes += [f"no-op `conveyor run` / no-op `dvc repro` ({n} stages): median {metrics[0].share():.2f}x (goal <= "
                  f"{NOOP_GOAL:g}x: {met(metrics[0].share() <= NOOP_GOAL)}); 1 stage: {metrics[1].share():.2f}x",
                  f"per skipped stage: goal <= {SKIP_GOAL_MS:g} ms: {met(median(per.candidate) <= SKIP_GOAL_MS)}",
                  projects.phases_note(f"a no-op `conveyor run` of the {n}-stage chain", chains[n].phases)]
        make_template(ref)
        if not config.quick:
            log(f"{NAME}: reference: first `conveyor run` (trains the models; not measured) on a prefect server")
            with PrefectServer() as server:
                first = projects.timed_cli(["conveyor", "run"], ref, projects.server_env(server), timeout=1800)
            stages = list(yaml.safe_load((ref / "dvc.yaml").read_text())["stages"])
            check_record(projects.run_record(ref), stages, "succeeded", "reference project, first run")
            idle = Idle(ref, stages, home)
            idle.unchanged("its first run")
            idle.warmed()
            log(f"{NAME}: reference: {repeats} interleaved repetitions")
            metric = Metric(f"no-op run, reference project, {len(stages)} stages (s); {GOAL}",
                            *interleaved(repeats, lambda _i: idle.dvc(), lambda _i: idle.conveyor(), log))
            metrics.append(metric)
            notes += [f"reference project: no-op `conveyor run` / no-op `dvc repro` median {metric.share():.2f}x "
                      f"(goal <= {NOOP_GOAL:g}x: {met(metric.share() <= NOOP_GOAL)}); its first run (not measured) "
                      f"took {first.seconds:.0f} s", projects.phases_note("a no-op `conveyor run` of the reference "
                                                                          "project", idle.phases)]
        log(f"{NAME}: CLI start-up: {repeats} interleaved repetitions in the reference copy (hyperfine)")
        for dvc_args, args in (("dvc --help", "conveyor --help"), ("dvc status", "conveyor validate")):
            metric = Metric(f"`{args}` vs `{dvc_args}` (s); goal: <= {CLI_GOAL_S:g} s",
                            *alternating(dvc_args.split(), args.split(), ref, no_server_env(home), repeats))
            metrics.append(metric)
            notes.append(f"`{args}`: goal <= {CLI_GOAL_S:g} s: {met(median(metric.candidate) <= CLI_GOAL_S)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="no-op `dvc repro` (or `dvc --help`, `dvc status`) in the same up-to-date project",
        candidate="no-op `conveyor run` (or `conveyor --help`, `conveyor validate`) there, no Prefect server",
        repeats=repeats, metrics=metrics,
        setup={"chains": ", ".join(map(str, chains)) + " stage(s)", "reference project": "skipped with --quick (its "
               "first run trains models; `dvc status` then lists every stage)" if config.quick else "up to date"},
        checks=["every command exited 0; every no-op `dvc repro` said the project is up to date; after every run "
                "`dvc status` was clean and dvc.lock as before; every no-op `conveyor run` wrote a new run record, "
                "every stage `skipped`, and left no process running"],
        notes=notes,
    )
