"""noop: what "nothing to do" costs: a no-op `conveyor run` vs a no-op `dvc repro`.

The peer is the command a user would type instead, `dvc repro`, in the same up-to-date
project. Three projects, each made in a temporary directory with the real CLIs
(``git init``, ``dvc init``, one commit) and brought up to date before anything is timed:

* a chain of 51 ``cmd`` stages in a hand-written dvc.yaml (10 with ``--quick``)::

      s00 -> s01 -> s02 -> ... -> s50

  ``s00`` writes ``out/s00.txt``; ``s<k>`` reads ``out/s<k-1>.txt`` (its one dep) and
  writes ``out/s<k>.txt`` (its one out) with a shell ``cat``/``echo``; one `dvc repro`
  brings it up to date;
* the same with one stage, and with 201 stages, so that the cost of one more skipped stage
  can be told from the fixed cost of a run: ``(T(201 stages) - T(1 stage)) / 200`` on each
  side (the 51-stage chain's difference, 50 x 2 ms = 0.1 s at the goal, is within what two
  runs of the same command differ by on a shared 2-core machine; 200 x 2 ms is not);
* the reference project of this repository: its files at HEAD (``git archive``, as
  ``benchmarks.overhead.reference`` makes it) in a new git repository, its committed
  dvc.yaml (compiled from configs/pipeline.yaml) and dvc.lock as they are, brought up to
  date by one `conveyor run` against a `prefect server start` started here (it trains its
  small models: 30-60 s); skipped with ``--quick``.

Then, in interleaved repetitions, `dvc repro` (baseline) and `conveyor run` (candidate)
in each: both have nothing to do. Every `conveyor run` here has PREFECT_API_URL unset and
a temporary PREFECT_HOME: a run with nothing to do should need no Prefect server at all,
so an implementation that starts its embedded server (seconds) is measured with it.

Expected bounds (the goals): a no-op `conveyor run` within 1.5x the no-op `dvc repro` of
the same project (ratio column >= 0.67); at most 2 ms per skipped stage; `conveyor --help`
and `conveyor validate` (in the reference copy) under 0.5 s each, reported against
`dvc --help` and `dvc status`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.overhead.reference import make_template
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import (
    chain_text,
    check_no_leftovers,
    check_record,
    cli,
    make_repo,
    no_server_env,
    out,
    per_stage_ms,
    phases,
    phases_note,
    run_record,
    server_env,
    stage,
    timed_cli,
)

NAME = "noop"
DESCRIPTION = ("nothing to do: no-op conveyor run vs no-op dvc repro (chains of 51, 1 and 201 stages, the "
               "reference project); CLI start-up")
UP_TO_DATE = "Data and pipelines are up to date."
NOOP_GOAL = 1.5  # a no-op conveyor run at most this many times the no-op dvc repro
SKIP_GOAL_MS = 2.0  # per skipped stage
CLI_GOAL_S = 0.5  # conveyor --help, conveyor validate
FIRST_RUN_TIMEOUT_S = 1800  # the reference project's first (training) run


# --- the projects -----------------------------------------------------------------------


def chain_dvc_yaml(n: int) -> str:
    """``n`` cmd stages in a chain, each a shell ``cat``/``echo`` of its dep into its out."""
    lines = ["stages:"]
    for k in range(n):
        cmd = (f"mkdir -p out && echo {stage(k)} > {out(k)}" if k == 0
               else f"(cat {out(k - 1)}; echo {stage(k)}) > {out(k)}")
        lines += [f"  {stage(k)}:", f"    cmd: {cmd}"]
        if k:
            lines += ["    deps:", f"      - {out(k - 1)}"]
        lines += ["    outs:", f"      - {out(k)}"]
    return "\n".join(lines) + "\n"


@dataclass
class Idle:
    """An up-to-date project: each no-op run is timed, then checked (exit 0, nothing ran,
    `dvc status` clean, dvc.lock byte for byte as it was)."""

    root: Path
    stages: list[str]
    env: dict[str, str]  # PREFECT_API_URL unset, a temporary PREFECT_HOME
    home: Path
    lock: bytes = b""
    run_id: str | None = None
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # conveyor: before/in/after the flow

    def settle(self) -> None:
        """Once up to date: `dvc status` clean; remember dvc.lock."""
        self._clean("after bringing it up to date")
        self.lock = (self.root / "dvc.lock").read_bytes()

    def dvc(self) -> float:
        run = timed_cli(["dvc", "repro"], self.root, self.env)
        check(UP_TO_DATE in run.stdout, f"{self.root.name}: no-op `dvc repro` did not say {UP_TO_DATE!r}:\n"
                                         f"{run.stdout[-3000:]}")
        self._unchanged("dvc repro")
        return run.seconds

    def conveyor(self) -> float:
        began = datetime.now(UTC)
        seconds = timed_cli(["conveyor", "run"], self.root, self.env).seconds
        record = run_record(self.root)
        check(record.get("run_id") != self.run_id, f"{self.root.name}: `conveyor run` left the last run record as "
                                                   "it was")
        self.run_id = record.get("run_id")
        check_record(record, self.stages, "skipped", f"{self.root.name}: no-op `conveyor run`")
        check_no_leftovers(self.home, f"{self.root.name}: no-op `conveyor run`")
        self._unchanged("conveyor run")
        self.phases.append(phases(record, began, seconds))
        return seconds

    def _clean(self, when: str) -> None:
        status = cli(["dvc", "status"], self.root, self.env)
        check(UP_TO_DATE in status.stdout, f"{self.root.name}: `dvc status` {when} is not clean:\n"
                                           f"{status.stdout[-3000:]}")

    def _unchanged(self, what: str) -> None:
        self._clean(f"after a no-op `{what}`")
        check((self.root / "dvc.lock").read_bytes() == self.lock, f"{self.root.name}: a no-op `{what}` changed "
                                                                  "dvc.lock")


def _chain_project(root: Path, n: int, home: Path, log: Callable[[str], None]) -> Idle:
    make_repo(root, {"dvc.yaml": chain_dvc_yaml(n)}, dvc=True)
    env = no_server_env(home)
    log(f"{NAME}: {root.name}: `dvc repro` of {n} stage(s) to bring it up to date")
    cli(["dvc", "repro"], root, env)
    missing = [out(k) for k in range(n) if (root / out(k)).read_text() != chain_text(k)]
    check(not missing, f"{root.name}: outs missing or wrong after `dvc repro`: {missing}")
    idle = Idle(root, [stage(k) for k in range(n)], env, home)
    idle.settle()
    return idle


def _reference_stages(root: Path) -> list[str]:
    data = yaml.safe_load((root / "dvc.yaml").read_text())
    return list(data["stages"])


# --- the benchmark ----------------------------------------------------------------------


def run(config: Config, log: Callable[[str], None]) -> Result:
    n = 10 if config.quick else 51
    slope_n = 10 if config.quick else 201  # the per-skipped-stage cost: (T(slope_n) - T(1)) / (slope_n - 1)
    repeats = config.reps(full=5, quick=2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-noop-"))
    home = scratch / "prefect-home"  # every conveyor command here: no API URL, this PREFECT_HOME
    home.mkdir()
    env = no_server_env(home)
    setup: dict[str, str] = {}
    metrics: list[Metric] = []
    notes: list[str] = []
    try:
        big = _chain_project(scratch / f"chain-{n}", n, home, log)
        small = _chain_project(scratch / "chain-1", 1, home, log)
        longest = big if slope_n == n else _chain_project(scratch / f"chain-{slope_n}", slope_n, home, log)
        chains = list({id(c): c for c in (big, small, longest)}.values())
        log(f"{NAME}: warm-up: one no-op of each command in each chain (not counted)")
        for idle in chains:
            idle.dvc()
            idle.conveyor()
            idle.phases.clear()
        log(f"{NAME}: {repeats} interleaved repetitions: no-op dvc repro vs no-op conveyor run, "
            f"{', '.join(str(len(c.stages)) for c in chains)} stage(s)")
        base, cand = interleaved(repeats, lambda _i: tuple(c.dvc() for c in chains),
                                 lambda _i: tuple(c.conveyor() for c in chains), log)
        at = {len(c.stages): k for k, c in enumerate(chains)}
        metrics += _chain_metrics(n, slope_n, [{m: b[k] for m, k in at.items()} for b in base],
                                  [{m: c[k] for m, k in at.items()} for c in cand], notes)
        notes.append(phases_note(f"a no-op `conveyor run` of the {n}-stage chain", big.phases))

        ref = scratch / "reference"
        make_template(ref)
        if config.quick:
            setup["reference project"] = "its no-op run is skipped with --quick (its first run trains models)"
        else:
            metrics.append(_reference(ref, env, home, repeats, log, notes))
        metrics += _cli_metrics(ref, env, repeats, config.quick, log, notes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    setup["chains"] = f"{n} and 1 stage(s)" + ("" if slope_n == n else f", and {slope_n} for the slope")
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="no-op `dvc repro` (or `dvc --help`, `dvc status`) in the same up-to-date project",
        candidate="no-op `conveyor run` (or `conveyor --help`, `conveyor validate`) there, no Prefect server",
        repeats=repeats, metrics=metrics, setup=setup,
        checks=["every command exited 0; every no-op `dvc repro` printed that the project is up to date",
                "after every run of either side `dvc status` was clean and dvc.lock byte for byte as before",
                "every no-op `conveyor run` wrote a new run record in which every stage is `skipped`, and no process "
                "of it outlived it"],
        notes=notes,
    )


def _chain_metrics(n: int, slope_n: int, base: list[dict[int, float]], cand: list[dict[int, float]],
                   notes: list[str]) -> list[Metric]:
    """The no-op ratios of the ``n``-stage chain and of 1 stage, and the per-skipped-stage slope
    from the ``slope_n``-stage chain; each repetition's seconds keyed by chain length."""
    goal = f"goal: <= {NOOP_GOAL:g}x, ratio >= {1 / NOOP_GOAL:.2f}"
    many = Metric(f"no-op run, {n}-stage chain (s); {goal}", [b[n] for b in base], [c[n] for c in cand])
    one = Metric(f"no-op run, 1 stage (s); {goal}", [b[1] for b in base], [c[1] for c in cand])
    per = Metric(f"per skipped stage (ms), (T({slope_n})-T(1))/{slope_n - 1}; goal: <= {SKIP_GOAL_MS:g} ms",
                 per_stage_ms([b[slope_n] for b in base], one.baseline, slope_n - 1),
                 per_stage_ms([c[slope_n] for c in cand], one.candidate, slope_n - 1), digits=1)
    metrics = [many, one]
    if slope_n != n:
        metrics.append(Metric(f"no-op run, {slope_n}-stage chain (s)", [b[slope_n] for b in base],
                              [c[slope_n] for c in cand]))
    conv_per = median(per.candidate)
    notes += [f"no-op `conveyor run` / no-op `dvc repro` ({n} stages): median {many.share():.2f}x "
              f"(goal <= {NOOP_GOAL:g}x: {met(many.share() <= NOOP_GOAL)}); 1 stage: {one.share():.2f}x",
              f"per skipped stage: conveyor {conv_per:.1f} ms, dvc repro {median(per.baseline):.1f} ms (medians of "
              f"the per-repetition (T({slope_n}) - T(1)) / {slope_n - 1}); goal <= {SKIP_GOAL_MS:g} ms: "
              f"{met(conv_per <= SKIP_GOAL_MS)}"]
    return [*metrics, per]


def _reference(ref: Path, env: dict[str, str], home: Path, repeats: int, log: Callable[[str], None],
               notes: list[str]) -> Metric:
    log(f"{NAME}: reference: starting prefect server for its first run")
    with PrefectServer() as server:
        log(f"{NAME}: reference: first `conveyor run` (trains the models; not measured) on {server.url}")
        seconds = timed_cli(["conveyor", "run"], ref, server_env(server), timeout=FIRST_RUN_TIMEOUT_S).seconds
    stages = _reference_stages(ref)
    check_record(run_record(ref), stages, "succeeded", "reference project, first run")
    idle = Idle(ref, stages, env, home)
    idle.settle()
    log(f"{NAME}: reference: first run took {seconds:.0f} s; warm-up no-ops (not counted)")
    idle.dvc()
    idle.conveyor()
    idle.phases.clear()
    log(f"{NAME}: reference: {repeats} interleaved repetitions")
    base, cand = interleaved(repeats, lambda _i: idle.dvc(), lambda _i: idle.conveyor(), log)
    metric = Metric(f"no-op run, reference project, {len(stages)} stages (s); goal: <= {NOOP_GOAL:g}x, ratio >= "
                    f"{1 / NOOP_GOAL:.2f}", base, cand)
    notes += [f"reference project: no-op `conveyor run` / no-op `dvc repro` median {metric.share():.2f}x (goal <= "
              f"{NOOP_GOAL:g}x: {met(metric.share() <= NOOP_GOAL)}); its first run (not measured) took {seconds:.0f} s",
              phases_note("a no-op `conveyor run` of the reference project", idle.phases)]
    return metric


def _cli_metrics(ref: Path, env: dict[str, str], repeats: int, quick: bool, log: Callable[[str], None],
                 notes: list[str]) -> list[Metric]:
    log(f"{NAME}: CLI start-up: {repeats} interleaved repetitions in the reference copy (hyperfine)")
    help_b, help_c = alternating(["dvc", "--help"], ["conveyor", "--help"], ref, env, repeats)
    val_b, val_c = alternating(["dvc", "status"], ["conveyor", "validate"], ref, env, repeats)
    help_m = Metric(f"`conveyor --help` vs `dvc --help` (s); goal: <= {CLI_GOAL_S:g} s", help_b, help_c)
    val_m = Metric(f"`conveyor validate` vs `dvc status` (s); goal: <= {CLI_GOAL_S:g} s", val_b, val_c)
    state = "before any run (--quick: outs absent, so `dvc status` lists every stage)" if quick else "up to date"
    notes.append(f"`conveyor validate` and `dvc status` ran in the reference copy, {state}")
    for m, what in ((help_m, "`conveyor --help`"), (val_m, "`conveyor validate`")):
        notes.append(f"{what}: median {median(m.candidate):.2f} s (min {min(m.candidate):.2f}, max "
                     f"{max(m.candidate):.2f}); goal <= {CLI_GOAL_S:g} s: {met(median(m.candidate) <= CLI_GOAL_S)}; "
                     f"the dvc command beside it: median {median(m.baseline):.2f} s")
    return [help_m, val_m]
