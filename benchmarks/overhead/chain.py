"""chain: what each stage that runs costs: 50 trivial steps in a chain, done four ways.

Each step reads the previous step's small file and writes the next one::

    out/s00.txt -> out/s01.txt -> ... -> out/s49.txt      (10 steps with --quick)

``s<k>`` writes the text of ``out/s<k-1>.txt`` plus its own name, so the last file lists
every step. All four sides call the same function (``steps/chain.py``, written here):

* a plain Python loop in one process (``python loop.py 50``): the floor, no orchestration;
* a bare Prefect flow of 50 ``@task``s (NO_CACHE, persist_result=False), each
  ``.submit(...).result()`` after the previous one: what Prefect alone costs;
* `dvc repro -f` of a dvc.yaml of 50 ``cmd`` stages (``python -c`` calling the step), deps
  the previous out, outs its own, in a project made with ``git init`` and ``dvc init``;
* `conveyor run --force` of a conveyor spec (configs/chain.yaml, in a project with its
  pyproject.toml, params.yaml and task package ``steps``) of 50 stages
  ``task: steps.chain:step``, deps the previous out, outs its own (conveyor's own
  fingerprint record: no dvc.yaml is compiled from the spec).

Every measured run starts from its own fresh copy of a pristine project (no outs, no lock,
no run record), so every side does the whole work each time. The main figures run the
Prefect flow and conveyor against one `prefect server start` started here before any
measurement (PREFECT_API_URL set; a long-running server, as a team keeps one); the last
figure has PREFECT_API_URL unset, so the bare flow gets Prefect's temporary server and
conveyor its embedded one, each run.

conveyor and the bare flow also run a 1-step chain, so that the fixed cost of a run (the
interpreter, imports, the flow run) can be told from the cost of one more stage:
``(T(50) - T(1)) / 49``. Expected bounds (the goals): at most 20 ms of orchestration per
stage that runs; conveyor no slower than `dvc repro -f` (which starts an interpreter per
stage) and within 1.5x the bare Prefect flow (the same bound as a no-op run against
`dvc repro`, see ``benchmarks.overhead.noop``); against the loop, within the loop's time plus a
0.5 s start (the CLI's goal) plus 20 ms per stage.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.overhead.noop import CLI_GOAL_S
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import (
    Copies,
    chain_text,
    check_no_leftovers,
    check_record,
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

NAME = "chain"
DESCRIPTION = "50 trivial chained steps: conveyor run --force vs a plain loop, a bare Prefect flow, dvc repro -f"
STAGE_GOAL_MS = 20.0  # orchestration per stage that runs
PREFECT_GOAL = 1.5  # conveyor at most this many times the bare Prefect flow
DVC_GOAL = 1.0  # conveyor at most this many times dvc repro -f

STEPS = '''\
"""The one step of the chain benchmark, as every side calls it."""

from pathlib import Path


def write(stage, prev, out):
    """``out``: the text of ``prev`` (none for the first step) and ``stage`` on a line of its own."""
    text = Path(prev).read_text() if prev is not None else ""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(f"{text}{stage}\\n")


def by_index(k):
    """Step ``k`` by its number (the loop, the bare Prefect flow, dvc's ``python -c``)."""
    write(f"s{k:02d}", f"out/s{k - 1:02d}.txt" if k else None, f"out/s{k:02d}.txt")


def step(ctx):
    """Step as a conveyor task: its one dep (none for the first) into its one out."""
    (dest,) = ctx.outs.values()
    write(ctx.stage, next(iter(ctx.deps.values()), None), dest)
'''

LOOP = '''\
"""The chain as a plain Python loop in one process."""

import sys

from steps.chain import by_index

for k in range(int(sys.argv[1])):
    by_index(k)
'''

IN_FLOW = "seconds in the flow: "  # what the bare flow prints: the span of its task loop

BARE_FLOW = '''\
"""The chain as a bare Prefect flow: one task per step, each awaited before the next."""

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


def dvc_yaml(n: int) -> str:
    lines = ["stages:"]
    for k in range(n):
        lines += [f"  {stage(k)}:", f"    cmd: python -c \"import steps.chain as c; c.by_index({k})\""]
        if k:
            lines += ["    deps:", f"      - {out(k - 1)}"]
        lines += ["    outs:", f"      - {out(k)}"]
    return "\n".join(lines) + "\n"


def conveyor_spec(n: int) -> str:
    lines = [f"pipeline: chain{n}", "task_packages: [steps]", "stages:"]
    for k in range(n):
        lines += [f"  {stage(k)}:", "    task: steps.chain:step"]
        if k:
            lines.append(f"    deps: [{out(k - 1)}]")
        lines.append(f"    outs: [{out(k)}]")
    return "\n".join(lines) + "\n"


def _write(root: Path, files: Mapping[str, str]) -> None:
    root.mkdir(parents=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


@dataclass
class Templates:
    """The pristine projects every run copies."""

    plain: Path  # loop.py, bare_flow.py, steps/
    dvc: dict[int, Path]  # steps count -> git + dvc project with its dvc.yaml
    conveyor: Path  # git project: pyproject.toml, params.yaml, steps/, configs/chain<n>.yaml

    @classmethod
    def make(cls, root: Path, n: int) -> Templates:
        steps = {"steps/__init__.py": "", "steps/chain.py": STEPS}
        _write(root / "plain", {**steps, "loop.py": LOOP, "bare_flow.py": BARE_FLOW})
        for size in (n, 1):
            make_repo(root / f"dvc-{size}", {**steps, "dvc.yaml": dvc_yaml(size)}, dvc=True)
        make_repo(root / "conveyor", {**steps, "pyproject.toml": '[project]\nname = "chain"\nversion = "0"\n',
                                      "params.yaml": "# the chain has no params\n{}\n",
                                      f"configs/chain{n}.yaml": conveyor_spec(n),
                                      "configs/chain1.yaml": conveyor_spec(1)}, dvc=False)
        return cls(root / "plain", {size: root / f"dvc-{size}" for size in (n, 1)}, root / "conveyor")


@dataclass
class Fresh:
    """Runs each command in its own fresh copy of a template, checks what it left, removes the copy."""

    copies: Copies
    phases: dict[tuple[str, int], list[tuple[float, float, float]]] = field(default_factory=dict)  # conveyor
    inside: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (side, steps): seconds in the flow
    left: int = 0  # runs of the bare flow whose temporary server outlived them (killed)

    def forget(self) -> None:
        """Drop what the uncounted warm-up runs left in ``phases`` and ``inside``."""
        self.phases.clear()
        self.inside.clear()

    def run(self, side: str, template: Path, args: Sequence[str], env: Mapping[str, str], n: int) -> float:
        with self.copies.fresh(template, side) as workdir:
            began = datetime.now(UTC)
            done = timed_cli(args, workdir, env, strict=side != "bare-flow-temporary-server")
            seconds = done.seconds
            self.left += done.left
            self._outs(workdir, n, side)
            if args[-2:-1] == ["bare_flow.py"]:
                lines = [line for line in done.stdout.splitlines() if line.startswith(IN_FLOW)]
                check(len(lines) == 1, f"{side}: the flow did not print {IN_FLOW!r}:\n{done.stdout[-2000:]}")
                self.inside.setdefault((side, n), []).append(float(lines[0].removeprefix(IN_FLOW)))
            if args[0] == "dvc":
                lock = yaml.safe_load((workdir / "dvc.lock").read_text())
                check(sorted(lock.get("stages", {})) == [stage(k) for k in range(n)],
                      f"{side}: dvc.lock does not record the {n} stages")
            elif args[0] == "conveyor":
                record = run_record(workdir)
                check_record(record, [stage(k) for k in range(n)], "succeeded", side)
                split = phases(record, began, seconds)
                self.phases.setdefault((side, n), []).append(split)
                self.inside.setdefault((side, n), []).append(split[1])
            return seconds

    @staticmethod
    def _outs(workdir: Path, n: int, side: str) -> None:
        wrong = [out(k) for k in range(n) if not (workdir / out(k)).is_file()
                 or (workdir / out(k)).read_text() != chain_text(k)]
        check(not wrong, f"{side}: outs missing or not as expected: {wrong}")
        made = sorted(p.name for p in (workdir / "out").iterdir() if p.name != ".gitignore")  # DVC's, for its outs
        check(len(made) == n, f"{side}: {len(made)} files in out/, expected {n}: {made}")


def run(config: Config, log: Callable[[str], None]) -> Result:
    n = 10 if config.quick else 50
    repeats = config.reps(full=5, quick=2)
    cold_repeats = 1 if config.quick else 2
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-chain-"))
    fresh = Fresh(Copies(scratch))
    python = "python"  # the interpreter first on base_env()'s PATH: this one's
    try:
        tpl = Templates.make(scratch / "templates", n)

        def loop(env: Mapping[str, str]) -> float:
            return fresh.run("loop", tpl.plain, [python, "loop.py", str(n)], env, n)

        def bare(env: Mapping[str, str], size: int, side: str = "bare-flow") -> float:
            return fresh.run(side, tpl.plain, [python, "bare_flow.py", str(size)], env, size)

        def dvc(env: Mapping[str, str], size: int) -> float:
            return fresh.run("dvc-repro-f", tpl.dvc[size], ["dvc", "repro", "-f"], env, size)

        def conveyor(env: Mapping[str, str], size: int, side: str = "conveyor") -> float:
            return fresh.run(side, tpl.conveyor, ["conveyor", "run", "-c", f"configs/chain{size}.yaml", "--force"],
                             env, size)

        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            env = server_env(server)
            log(f"{NAME}: prefect server up in {server.startup_s:.1f} s on {server.url}")
            log(f"{NAME}: warm-up (one run of each side, not counted)")
            loop(env)
            bare(env, n)
            dvc(env, 1)
            conveyor(env, n)
            fresh.forget()
            log(f"{NAME}: {repeats} interleaved repetitions of {n} and 1 step(s), on the shared server")

            def peers(_i: int) -> dict[str, float]:
                return {"loop": loop(env), "bare": bare(env, n), "bare1": bare(env, 1), "dvc": dvc(env, n),
                        "dvc1": dvc(env, 1)}

            base, cand = interleaved(repeats, peers,
                                     lambda _i: {"conveyor": conveyor(env, n), "conveyor1": conveyor(env, 1)}, log)
            startup_s = server.startup_s

        home = scratch / "prefect-home-embedded"
        home.mkdir()
        cold_env = no_server_env(home)

        def cold_bare(size: int) -> float:
            return bare(cold_env, size, "bare-flow-temporary-server")

        def cold_conveyor(size: int) -> float:
            seconds = conveyor(cold_env, size, "conveyor-embedded-server")
            check_no_leftovers(home, "conveyor run with its embedded server")
            return seconds

        log(f"{NAME}: PREFECT_API_URL unset: warm-up (creates the temporary PREFECT_HOME's database, not counted)")
        cold_bare(1)
        cold_conveyor(1)
        for side in ("conveyor-embedded-server", "bare-flow-temporary-server"):  # the warm-up's, not counted
            fresh.phases.pop((side, 1), None)
            fresh.inside.pop((side, 1), None)
        log(f"{NAME}: {cold_repeats} interleaved repetitions, PREFECT_API_URL unset")
        cold_base, cold_cand = interleaved(cold_repeats, lambda _i: cold_bare(n), lambda _i: cold_conveyor(n), log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(n, repeats, startup_s, (base, cand), (cold_base, cold_cand), fresh)


def _col(rows: Sequence[Mapping[str, float]], key: str) -> list[float]:
    return [row[key] for row in rows]


def _result(n: int, repeats: int, startup_s: float, warm: tuple[list[dict[str, float]], list[dict[str, float]]],
            cold: tuple[list[float], list[float]], fresh: Fresh) -> Result:
    base, cand = warm
    conv = _col(cand, "conveyor")
    budget_s = CLI_GOAL_S + n * STAGE_GOAL_MS / 1000
    vs_loop = Metric(f"{n} steps, wall (s), vs plain Python loop; goal: <= loop + {CLI_GOAL_S:g} s + "
                     f"{STAGE_GOAL_MS:g} ms/step", _col(base, "loop"), conv)
    vs_bare = Metric(f"{n} steps, wall (s), vs bare Prefect flow; goal: <= {PREFECT_GOAL:g}x, ratio >= "
                     f"{1 / PREFECT_GOAL:.2f}", _col(base, "bare"), conv)
    vs_dvc = Metric(f"{n} steps, wall (s), vs dvc repro -f; goal: <= {DVC_GOAL:g}x, ratio >= {1 / DVC_GOAL:.2f}",
                    _col(base, "dvc"), conv)
    per = Metric(f"per stage that runs (ms), (T({n})-T(1))/{n - 1}, vs Prefect task; goal: <= {STAGE_GOAL_MS:g} ms",
                 per_stage_ms(_col(base, "bare"), _col(base, "bare1"), n - 1),
                 per_stage_ms(conv, _col(cand, "conveyor1"), n - 1), digits=1)
    flows = fresh.inside
    in_flow = Metric(f"per stage in the flow (ms), (F({n})-F(1))/{n - 1}, vs Prefect task; goal: <= "
                     f"{STAGE_GOAL_MS:g} ms",
                     per_stage_ms(flows["bare-flow", n], flows["bare-flow", 1], n - 1),
                     per_stage_ms(flows["conveyor", n], flows["conveyor", 1], n - 1), digits=1)
    embedded = Metric(f"{n} steps, wall (s), no server running, vs bare Prefect flow; goal: <= {PREFECT_GOAL:g}x",
                      cold[0], cold[1])
    loop_goal = median(vs_loop.baseline) / (median(vs_loop.baseline) + budget_s)
    dvc_per = per_stage_ms(_col(base, "dvc"), _col(base, "dvc1"), n - 1)
    conv_per = median(per.candidate)
    m = {name: median(values) for name, values in (
        ("loop", vs_loop.baseline), ("bare", vs_bare.baseline), ("bare1", _col(base, "bare1")),
        ("dvc", vs_dvc.baseline), ("dvc1", _col(base, "dvc1")), ("conveyor", conv),
        ("conveyor1", _col(cand, "conveyor1")), ("cold_bare", cold[0]), ("cold_conveyor", cold[1]))}
    notes = [
        f"medians (s), shared server: plain loop {m['loop']:.2f}; bare Prefect flow {m['bare']:.2f} ({n} tasks), "
        f"{m['bare1']:.2f} (1 task); dvc repro -f {m['dvc']:.2f} ({n} stages), {m['dvc1']:.2f} (1); conveyor run "
        f"--force {m['conveyor']:.2f} ({n} stages), {m['conveyor1']:.2f} (1)",
        f"per stage that runs (medians of the per-repetition (T({n}) - T(1)) / {n - 1}): conveyor {conv_per:.1f} ms, "
        f"bare Prefect flow {median(per.baseline):.1f} ms, dvc repro -f {median(dvc_per):.1f} ms; goal conveyor <= "
        f"{STAGE_GOAL_MS:g} ms: {met(conv_per <= STAGE_GOAL_MS)} (wall times: the jitter of a process's start and "
        "exit, Prefect's flushing of its logs and events at exit above all, can exceed the difference with few "
        "steps or repetitions; row 5 leaves them out)",
        f"vs the loop: goal conveyor <= loop + {CLI_GOAL_S:g} s start + {n} x {STAGE_GOAL_MS:g} ms = "
        f"{m['loop'] + budget_s:.2f} s, i.e. ratio >= {loop_goal:.2f}: {met(m['conveyor'] <= m['loop'] + budget_s)}",
        f"vs the bare Prefect flow: conveyor took {vs_bare.share():.2f}x its time (goal <= {PREFECT_GOAL:g}x: "
        f"{met(vs_bare.share() <= PREFECT_GOAL)}); with the servers each starts itself (PREFECT_API_URL unset) "
        f"{embedded.share():.2f}x: bare flow {m['cold_bare']:.2f} s, conveyor {m['cold_conveyor']:.2f} s",
        f"vs dvc repro -f: conveyor took {vs_dvc.share():.2f}x its time (goal <= {DVC_GOAL:g}x: "
        f"{met(vs_dvc.share() <= DVC_GOAL)})",
    ]
    notes.append(f"per stage inside the flow (row 5; F is the time inside the flow, less noisy than the wall: no "
                 f"interpreter start, no exit; for the bare flow the span of its task loop, for conveyor its run "
                 f"record's started -> finished): conveyor {median(in_flow.candidate):.1f} ms, bare Prefect task "
                 f"{median(in_flow.baseline):.1f} ms; F({n}) medians: bare flow {median(flows['bare-flow', n]):.2f} "
                 f"s, conveyor {median(flows['conveyor', n]):.2f} s; goal conveyor <= {STAGE_GOAL_MS:g} ms: "
                 f"{met(median(in_flow.candidate) <= STAGE_GOAL_MS)}")
    for side, what in (("conveyor", "shared server"), ("conveyor-embedded-server", "embedded server")):
        if fresh.phases.get((side, n)):
            notes.append(phases_note(f"`conveyor run --force` ({what}, {n} stages)", fresh.phases[side, n]))
    if fresh.left:
        notes.append(f"the bare Prefect flow left its temporary server running 10 s after it exited in {fresh.left} "
                     "run(s) (killed before the next run)")
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"the same {n} steps as a plain Python loop, a bare Prefect flow of {n} tasks, `dvc repro -f` of "
                 f"{n} cmd stages",
        candidate=f"`conveyor run --force` of a spec of {n} task stages (steps.chain:step)",
        repeats=repeats, metrics=[vs_loop, vs_bare, vs_dvc, per, in_flow, embedded],
        setup={"prefect server start": f"up in {startup_s:.1f} s before the first measurement (rows 1-5)",
               "repetitions without a server (row 6)": str(len(cold[0]))},
        checks=["every command exited 0; every run of every side left the same out/s00.txt ... "
                f"out/s{n - 1:02d}.txt and nothing else in out/ (DVC's .gitignore aside)",
                "dvc.lock (dvc repro -f) and the run record (conveyor: every stage succeeded) list every stage",
                "no process of conveyor's embedded Prefect server outlived its run"],
        notes=notes,
    )
