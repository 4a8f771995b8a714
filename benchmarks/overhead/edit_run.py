"""edit-run: the edit-run loop as a new user meets it, no PREFECT_API_URL: forcing one trivial stage.

A git + DVC project of three ``echo`` stages (prepare -> train -> report). The session's first `conveyor run`
(it starts the Prefect server conveyor keeps) is reported beside a twin's first `dvc repro`; then, once the
warm runner it started serves, hyperfine alternates `dvc repro -s -f report` and `conveyor run -s -f report`.
Checked: each ran exactly ``report``, dvc.lock holds the three stages, the warm runner forked every forced
run, nothing is left after `conveyor server stop`. Goals (issue 34): at most 1.5x `dvc repro -s -f`, 1.5 s.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, median, met
from benchmarks.processes import wait_warm
from benchmarks.projects import base_env, check_no_leftovers, cli, make_repo, no_server_env, run_record, timed_cli
from conveyor.cli.warm_runner import runners

NAME = "edit-run"
DESCRIPTION = ("the edit-run loop with no PREFECT_API_URL: conveyor run -s -f STAGE vs dvc repro -s -f STAGE "
               "after a first run (the kept Prefect server, the warm runner); the first run of a session as it is")
RATIO_GOAL, SECONDS_GOAL = 1.5, 1.5
DVC_YAML = {"stages": {
    "prepare": {"cmd": "echo prepared > prepared.txt", "outs": ["prepared.txt"]},
    "train": {"cmd": "cat prepared.txt > model.txt && echo trained >> model.txt", "deps": ["prepared.txt"],
              "outs": ["model.txt"]},
    "report": {"cmd": "wc -l model.txt > report.txt", "deps": ["model.txt"], "outs": ["report.txt"]},
}}


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=7, quick=3)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-edit-run-"))
    home, project, twin = scratch / "prefect-home", scratch / "project", scratch / "twin"
    home.mkdir()
    env = no_server_env(home)
    try:
        for root in (project, twin):
            make_repo(root, {"dvc.yaml": yaml.safe_dump(DVC_YAML, sort_keys=False)}, dvc=True)
        log(f"{NAME}: the first run of the session (it starts the kept Prefect server)")
        first_dvc = timed_cli(["dvc", "repro"], twin, base_env())
        first = timed_cli(["conveyor", "run"], project, env)
        check(run_record(project)["status"] == "succeeded", "the first conveyor run did not succeed")
        status = cli(["conveyor", "server", "status"], project, env).stdout
        check("url:" in status, f"no Prefect server kept after the first run:\n{status}")
        warm = wait_warm(home)  # as a user's next edit comes seconds later: the runner has imported by then
        log(f"{NAME}: {repeats} alternating repetitions of the forced stage")
        base, cand = alternating(["dvc", "repro", "-s", "-f", "report"], ["conveyor", "run", "-s", "-f", "report"],
                                 project, env, repeats)
        ran = sorted(name for name, s in run_record(project)["stages"].items() if s["status"] == "succeeded")
        check(ran == ["report"], f"conveyor run -s -f report ran {ran}")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the warm runner did not fork every forced run ({served})")
        lock = yaml.safe_load((project / "dvc.lock").read_text())
        check(set(lock["stages"]) == set(DVC_YAML["stages"]), f"dvc.lock holds {sorted(lock['stages'])}")
        cli(["conveyor", "server", "stop"], project, env)
        check_no_leftovers(home, "the edit-run loop")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    forced = Metric("forced one trivial stage after the first run (s)", base, cand)
    session = Metric("first run of a session, 3 stages (s; conveyor starts its Prefect server)",
                     [first_dvc.seconds], [first.seconds])
    ratio, seconds = forced.share(), median(cand)
    return Result(
        name=NAME, description=DESCRIPTION, baseline="dvc repro", candidate="conveyor run (no PREFECT_API_URL)",
        repeats=repeats, metrics=[forced, session],
        setup={"project": "3 cmd stages in a hand-written dvc.yaml (git + DVC)", "forced": "report",
               "prefect": "no PREFECT_API_URL, the benchmark's own PREFECT_HOME: the server conveyor keeps"},
        checks=["each forced conveyor run ran exactly `report` (run record); dvc.lock holds the three stages",
                "the warm runner forked every forced run; `conveyor server stop` left nothing running"],
        notes=[f"forced stage: conveyor {ratio:.2f}x dvc repro -s -f (goal <= {RATIO_GOAL}x: "
               f"{met(ratio <= RATIO_GOAL)}); {seconds:.2f} s (goal <= {SECONDS_GOAL} s: "
               f"{met(seconds <= SECONDS_GOAL)})"],
    )
