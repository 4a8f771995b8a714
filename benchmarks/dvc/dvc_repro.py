"""dvc-repro: `conveyor run` vs `dvc repro` of the same hand-written dvc.yaml.

The peer is DVC itself: `dvc repro` of a DVC project's own dvc.yaml, which conveyor now
runs as it is (DVC's parser, status and lock writer). A project made in a temporary
directory with the real CLIs (``git init``, ``dvc init``) holds this dvc.yaml::

                  +--> branch@a --+
                  +--> branch@b --+
    prepare ------+--> branch@c --+--> join
                  +--> branch@d --+

``prepare`` writes a small file; each branch (a ``foreach`` over a, b, c, d) sleeps a
fixed time (the simulated work: waiting on a service, a GPU, a queue) and writes its out
from prepare's; ``join`` concatenates the four. `dvc repro` runs one stage at a time, so
its branches take 4 x sleep; conveyor runs independent local stages at once, as many as
there are CPU cores (``os.cpu_count()``), so on a 2-core machine 2 at a time: 2 x sleep.
The expected bound on the wall-time ratio is therefore 4 / ceil(4 / min(4, cores)) (2x
on 2 cores, 4x on 4 or more), less what conveyor spends besides the stages (interpreter
start, imports, loading dvc.yaml through DVC, the Prefect flow run) beyond what
`dvc repro` spends on its own start and hashing.

A fourth row runs the same dvc.yaml with ``conveyor run -c configs/placed.yaml``: a
conveyor spec beside it (dvc.yaml untouched) that places the branches on a threads profile
of 4, as a user whose stages wait rather than compute would; then all four wait at once.

Every measured run starts from its own fresh copy of the same pristine project (no lock,
no outs, no run cache), so both sides do the same work. The main figure runs conveyor
against one `prefect server start` started here before any measurement (a long-running
server, as a team would keep one). With PREFECT_API_URL unset, a user's default, conveyor
keeps a local server for the runs after the first one: the fifth row runs against that kept
server (started by an uncounted run, stopped with `conveyor server stop` at the end); the
third lets each `conveyor run` start a server of its own (``CONVEYOR_SERVER_IDLE=0``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import Config, Metric, Result, check, interleaved
from benchmarks.prefect_server import PrefectServer
from benchmarks.processes import leftovers
from benchmarks.projects import (
    Copies,
    base_env,
    cli,
    make_repo,
    no_server_env,
    phases,
    phases_note,
    server_env,
    timed_cli,
)

NAME = "dvc-repro"
DESCRIPTION = "conveyor run vs dvc repro on the same hand-written dvc.yaml (4 independent branches)"
ITEMS = ("a", "b", "c", "d")
BRANCHES = [f"branch@{item}" for item in ITEMS]
STAGES = ["prepare", *BRANCHES, "join"]
OUTS = ["data/prepared.txt", *(f"out/{item}.txt" for item in ITEMS), "data/joined.txt"]
UP_TO_DATE = "Data and pipelines are up to date."
PLACED = "configs/placed.yaml"  # the branches on a threads profile: what a user whose stages wait writes
PLACED_SPEC = f"""\
# beside the untouched dvc.yaml: its branches wait (on a service, a queue), so they need no core each
dvc: dvc.yaml
profiles:
  waits: {{kind: threads, max_workers: {len(ITEMS)}}}
placement:
  "branch@*": {{on: waits}}
"""
CORES = os.cpu_count() or 1  # conveyor's bound on local stages at once
AT_ONCE = min(len(ITEMS), CORES)

DVC_YAML = """\
vars:
  - sleep_s: {sleep_s}
stages:
  prepare:
    cmd: mkdir -p data && printf 'prepared for the branches\\n' > data/prepared.txt
    outs:
      - data/prepared.txt
  branch:
    foreach: [{items}]
    do:
      cmd: sleep ${{sleep_s}} && mkdir -p out && (cat data/prepared.txt; echo ${{item}}) > out/${{item}}.txt
      deps:
        - data/prepared.txt
      outs:
        - out/${{item}}.txt
  join:
    cmd: cat {branch_outs} > data/joined.txt
    deps: [{branch_deps}]
    outs:
      - data/joined.txt
"""


@dataclass(frozen=True)
class Outcome:
    """What one run left behind: its wall time, its outs, dvc.lock, the .gitignore files DVC keeps."""

    wall: float
    outs: Mapping[str, str]
    lock: Mapping[str, Any]
    gitignores: Mapping[str, str]
    phases: tuple[float, float, float] | None = None  # conveyor: seconds before, in and after the flow
    branch_s: tuple[float, ...] = ()  # conveyor: each branch's duration_s in the run record
    at_once: int = 1  # most branches running at the same moment (conveyor's run record)


def dvc_yaml(sleep_s: float) -> str:
    outs = [f"out/{item}.txt" for item in ITEMS]
    return DVC_YAML.format(sleep_s=sleep_s, items=", ".join(ITEMS), branch_outs=" ".join(outs),
                           branch_deps=", ".join(outs))


def make_template(root: Path, sleep_s: float) -> None:
    """The pristine project every run copies: a git repository, `dvc init`, the dvc.yaml, one commit."""
    make_repo(root, {"dvc.yaml": dvc_yaml(sleep_s), PLACED: PLACED_SPEC}, dvc=True)


def _max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most intervals open at the same moment (an end at the moment of a start does not overlap)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def observe(workdir: Path, env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any], dict[str, str]]:
    """After a run: `dvc status` is clean; the outs, dvc.lock (parsed) and every .gitignore."""
    status = cli(["dvc", "status"], workdir, env)
    check(UP_TO_DATE in status.stdout, f"`dvc status` in {workdir.name} is not clean:\n{status.stdout[-3000:]}")
    missing = [out for out in OUTS if not (workdir / out).is_file()]
    check(not missing, f"{workdir.name}: outs missing after the run: {missing}")
    outs = {out: (workdir / out).read_text() for out in OUTS}
    lock = yaml.safe_load((workdir / "dvc.lock").read_text())
    check(isinstance(lock, dict) and sorted(lock.get("stages", {})) == sorted(STAGES),
          f"{workdir.name}: dvc.lock does not record exactly {STAGES}: {sorted((lock or {}).get('stages', {}))}")
    ignores = {str(p.relative_to(workdir)): "\n".join(sorted(p.read_text().splitlines()))
               for p in sorted(workdir.rglob(".gitignore")) if not _own_state(p.relative_to(workdir))}
    return outs, lock, ignores


def _own_state(path: Path) -> bool:
    """A .gitignore of git's, DVC's or conveyor's own folders (not one DVC writes for outs)."""
    return bool({".git", ".dvc", ".conveyor"} & set(path.parts))


def _record(workdir: Path) -> tuple[dict[str, Any], tuple[float, ...], int]:
    """conveyor's run record (checked: every stage ran), its branches' durations and the most at once."""
    record: dict[str, Any] = json.loads((workdir / ".conveyor/runs/latest.json").read_text())
    stages = record["stages"]
    check(record["status"] == "succeeded" and sorted(stages) == sorted(STAGES)
          and all(s["status"] == "succeeded" and "run cache" not in (s.get("reason") or "") for s in stages.values()),
          f"{workdir.name}: not every stage ran: { {n: (s['status'], s.get('reason')) for n, s in stages.items()} }")
    spans = [(datetime.fromisoformat(stages[b]["started"]), datetime.fromisoformat(stages[b]["finished"]))
             for b in BRANCHES]
    return record, tuple(float(stages[b]["duration_s"]) for b in BRANCHES), _max_overlap(spans)


class Twins:
    """Each run in a fresh copy of the template, timed by hyperfine, observed, removed."""

    def __init__(self, template: Path, scratch: Path) -> None:
        self.template, self.copies = template, Copies(scratch)

    def run(self, side: str, args: list[str], env: Mapping[str, str]) -> Outcome:
        with self.copies.fresh(self.template, side) as workdir:
            began = datetime.now(UTC)
            seconds = timed_cli(args, workdir, env).seconds
            outs, lock, ignores = observe(workdir, env)
            if args[0] != "conveyor":
                return Outcome(seconds, outs, lock, ignores)
            record, branch_s, at_once = _record(workdir)
            return Outcome(seconds, outs, lock, ignores, phases(record, began, seconds), branch_s, at_once)


def check_same(base: list[Outcome], cand: list[Outcome], what: str) -> None:
    """Each repetition's two runs left equal outs, equal dvc.lock stage entries, equal .gitignore files."""
    for i, (b, c) in enumerate(zip(base, cand, strict=True), start=1):
        diff = [out for out in OUTS if b.outs[out] != c.outs[out]]
        check(not diff, f"{what}, repetition {i}: outs differ: {diff}")
        check(b.lock.get("schema") == c.lock.get("schema"), f"{what}, repetition {i}: dvc.lock schema differs")
        lock_diff = [s for s in STAGES if b.lock["stages"][s] != c.lock["stages"][s]]
        check(not lock_diff, f"{what}, repetition {i}: dvc.lock differs for {lock_diff}:\n"
                             + "\n".join(f"  dvc repro: {b.lock['stages'][s]}\n  conveyor:  {c.lock['stages'][s]}"
                                         for s in lock_diff))
        check(b.gitignores == c.gitignores, f"{what}, repetition {i}: .gitignore files differ: dvc repro "
                                            f"{b.gitignores} vs conveyor {c.gitignores}")


def run(config: Config, log: Callable[[str], None]) -> Result:
    sleep_s = 1.0 if config.quick else 3.0
    repeats = config.reps(full=5, quick=2)
    cold_repeats = 1 if config.quick else 2
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-dvc-repro-"))
    twins = Twins(scratch / "template", scratch)
    cold_home, kept_home = scratch / "prefect-home", scratch / "prefect-home-kept"
    repro, conveyor = ["dvc", "repro"], ["conveyor", "run"]
    try:
        make_template(scratch / "template", sleep_s)
        cold_home.mkdir()
        kept_home.mkdir()
        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            log(f"{NAME}: prefect server up in {server.startup_s:.1f} s on {server.url}")
            log(f"{NAME}: warm-up (one conveyor run on the server, not counted)")
            env = server_env(server)
            twins.run("warm-up", conveyor, env)
            log(f"{NAME}: {repeats} interleaved repetitions, conveyor on the shared server")
            base, cand = interleaved(repeats, lambda _i: twins.run("dvc-repro", repro, env),
                                     lambda _i: twins.run("conveyor", conveyor, env), log)
            log(f"{NAME}: {repeats} interleaved repetitions, conveyor with the branches placed on a threads "
                f"profile ({PLACED})")
            placed = interleaved(repeats, lambda _i: twins.run("dvc-repro", repro, env),
                                 lambda _i: twins.run("conveyor-placed", [*conveyor, "-c", PLACED], env), log)
            startup_s = server.startup_s

        def cold(_i: int) -> Outcome:
            outcome = twins.run("conveyor-cold", conveyor, {**no_server_env(cold_home), "CONVEYOR_SERVER_IDLE": "0"})
            left = leftovers(cold_home)
            check(not left, f"conveyor run left processes of its embedded Prefect server running 10 s after it "
                            f"exited (pids {left}, killed)")
            return outcome

        log(f"{NAME}: cold: one conveyor run with the embedded server to create its database, not counted")
        cold(0)
        log(f"{NAME}: {cold_repeats} interleaved repetitions, conveyor with its embedded server")
        cold_base, cold_cand = interleaved(cold_repeats, lambda _i: twins.run("dvc-repro", repro, base_env()),
                                           cold, log)
        kept_env = no_server_env(kept_home)
        log(f"{NAME}: kept: one conveyor run starts the server conveyor keeps, not counted")
        twins.run("conveyor-kept-first", conveyor, kept_env)
        log(f"{NAME}: {repeats} interleaved repetitions, conveyor on the server it keeps")
        kept = interleaved(repeats, lambda _i: twins.run("dvc-repro", repro, base_env()),
                           lambda _i: twins.run("conveyor-kept", conveyor, kept_env), log)
        cli(["conveyor", "server", "stop"], scratch / "template", kept_env)
        check(not leftovers(kept_home), "a process of the kept server outlived `conveyor server stop` by 10 s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check_same(base, cand, "shared server")
    check_same(*placed, "shared server, branches placed")
    check_same(cold_base, cold_cand, "embedded server")
    check_same(*kept, "kept server")
    return _result(sleep_s, startup_s, (base, cand), (cold_base, cold_cand), placed, kept)


def _result(sleep_s: float, startup_s: float, warm: tuple[list[Outcome], list[Outcome]],
            cold: tuple[list[Outcome], list[Outcome]], placed: tuple[list[Outcome], list[Outcome]],
            kept: tuple[list[Outcome], list[Outcome]]) -> Result:
    base, cand = warm
    serial_sleep = len(ITEMS) * sleep_s
    parallel_sleep = math.ceil(len(ITEMS) / AT_ONCE) * sleep_s
    wall = Metric("wall of the command (s), conveyor on a shared Prefect server",
                  [o.wall for o in base], [o.wall for o in cand])
    overhead = Metric(f"wall minus the sleeps it must wait (s): dvc {serial_sleep:g} s serial, conveyor "
                      f"{parallel_sleep:g} s ({AT_ONCE} at once)",
                      [o.wall - serial_sleep for o in base], [o.wall - parallel_sleep for o in cand])
    cold_wall = Metric("wall of the command (s), conveyor starting a Prefect server of its own",
                       [o.wall for o in cold[0]], [o.wall for o in cold[1]])
    kept_wall = Metric("wall of the command (s), no PREFECT_API_URL: the server conveyor keeps",
                       [o.wall for o in kept[0]], [o.wall for o in kept[1]])
    placed_wall = Metric(f"wall of the command (s), conveyor with the branches on a threads profile ({PLACED}), "
                         "shared server", [o.wall for o in placed[0]], [o.wall for o in placed[1]])
    at_once = sorted({o.at_once for o in (*cand, *cold[1], *kept[1])})
    check(at_once == [AT_ONCE], f"conveyor ran {at_once} branches at once, expected {AT_ONCE} "
                                f"(min(4, os.cpu_count()={CORES}))")
    placed_at_once = sorted({o.at_once for o in placed[1]})
    check(placed_at_once == [len(ITEMS)], f"with {PLACED} conveyor ran {placed_at_once} branches at once, "
                                          f"expected all {len(ITEMS)}")
    bound = len(ITEMS) / math.ceil(len(ITEMS) / AT_ONCE)
    cand_wall = statistics.median(wall.candidate)
    extra = sorted(d - sleep_s for o in cand for d in o.branch_s)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`dvc repro` in a fresh copy of the project (one stage at a time)",
        candidate="`conveyor run` in another fresh copy of the same project (independent stages at once)",
        repeats=len(base), metrics=[wall, overhead, cold_wall, placed_wall, kept_wall],
        setup={"sleep per branch": f"{sleep_s:g} s",
               "ideal": f"dvc repro sleeps {serial_sleep:g} s; conveyor {AT_ONCE} at once on {CORES} cores, "
                        f"{parallel_sleep:g} s: a wall ratio bound of {bound:.2f}x (before start-up costs)",
               "prefect server start (rows 1, 2, 4)": f"up in {startup_s:.1f} s before the first measurement",
               "repetitions with the embedded server (row 3)": str(len(cold[0]))},
        checks=["every run exited 0, and `dvc status` was clean after it",
                f"every out ({', '.join(OUTS)}), dvc.lock's schema and stage entries, and the .gitignore files DVC "
                "writes for outs equal on both sides of each repetition",
                f"conveyor's run record: every stage succeeded, none restored from the run cache, {AT_ONCE} branches "
                f"at once ({len(ITEMS)} with {PLACED}); no process of its embedded server outlived a cold run"],
        notes=[f"wall minus the sum of the sleeps ({serial_sleep:g} s) on both sides: dvc repro "
               f"{statistics.median(wall.baseline) - serial_sleep:.2f} s, conveyor {cand_wall - serial_sleep:.2f} s "
               f"(medians; conveyor's is its overhead less the {serial_sleep - parallel_sleep:g} s its "
               "overlapping sleeps save)",
               phases_note(f"`conveyor run` ({cand_wall:.2f} s, shared server; {parallel_sleep:g} s of sleeps on its "
                           "critical path)", [o.phases for o in cand if o.phases]),
               phases_note("`conveyor run` with its embedded server (row 3)", [o.phases for o in cold[1] if o.phases]),
               f"conveyor's branch stages took their sleep plus median {extra[len(extra) // 2]:.2f} s, max "
               f"{extra[-1]:.2f} s (the shell, DVC's hashing and recording, Prefect's task run)",
               f"conveyor wall / dvc repro wall (the inverse of the ratio column): median {wall.share():.2f} with "
               f"the shared server, {cold_wall.share():.2f} with a server per run, {placed_wall.share():.2f} with "
               f"the branches placed on a threads profile, {kept_wall.share():.2f} with the server conveyor keeps "
               f"(issue 34's goal for a project of independent branches, cold: <= 0.8: "
               f"{'met' if kept_wall.share() <= 0.8 else 'NOT met'})"],
    )
