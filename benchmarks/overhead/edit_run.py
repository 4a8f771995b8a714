"""edit-run: the edit-run loop as a new user meets it, no PREFECT_API_URL: forcing one trivial stage.

The peer is `dvc repro -s -f STAGE` of the same stage, in the same project: a DVC project made
in a temporary directory with the real CLIs (``git init``, ``dvc init``, one commit) holding a
hand-written dvc.yaml of three ``cmd`` stages::

    prepare -> train -> report

each an ``echo`` into its out. No PREFECT_API_URL and a PREFECT_HOME of the benchmark's own, as
on a new user's machine: the first `conveyor run` of the session starts the local Prefect server
that conveyor then keeps for the runs after it (``conveyor server status``); that first run is
reported as it is, beside the first `dvc repro` of a twin project. Then, alternating (hyperfine,
one run per side per repetition, B C then C B), `dvc repro -s -f report` and
`conveyor run -s -f report`: both run the one stage and record it in dvc.lock.

Before them the benchmark waits for the warm runner the first run started (``conveyor.cli.warm``:
it imports Prefect and DVC once the first run has ended, as a user's next edit comes seconds
later), and checks that it forked every forced run.

Checked: each side's run ran exactly ``report`` (the run record; dvc.lock's ``report`` entry
equal after both), the warm runner forked the forced runs, and at the end the kept server and the
runner are stopped by ``conveyor server stop`` and nothing else of the runs is left running.

Goals (issue 34): forcing one trivial stage after the first run at most 1.5x `dvc repro -s -f`,
and at most 1.5 s.
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
RATIO_GOAL = 1.5
SECONDS_GOAL = 1.5
STAGES = ("prepare", "train", "report")

DVC_YAML = {"stages": {
    "prepare": {"cmd": "echo prepared > prepared.txt", "outs": ["prepared.txt"]},
    "train": {"cmd": "cat prepared.txt > model.txt && echo trained >> model.txt", "deps": ["prepared.txt"],
              "outs": ["model.txt"]},
    "report": {"cmd": "wc -l model.txt > report.txt", "deps": ["model.txt"], "outs": ["report.txt"]},
}}


def make_project(root: Path) -> None:
    make_repo(root, {"dvc.yaml": yaml.safe_dump(DVC_YAML, sort_keys=False)}, dvc=True)


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=7, quick=3)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-edit-run-"))
    home, project, twin = scratch / "prefect-home", scratch / "project", scratch / "twin"
    home.mkdir()
    env = no_server_env(home)
    try:
        make_project(project)
        make_project(twin)
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
        record = run_record(project)
        ran = sorted(name for name, stage in record["stages"].items() if stage["status"] == "succeeded")
        check(ran == ["report"], f"conveyor run -s -f report ran {ran}")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the forced runs were not all forked by the warm runner "
                                                     f"(it served {served})")
        lock = yaml.safe_load((project / "dvc.lock").read_text())
        check(set(lock["stages"]) == set(STAGES), f"dvc.lock holds {sorted(lock['stages'])}")
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
        checks=["each forced conveyor run ran exactly `report` (run record)",
                "dvc.lock holds the three stages after both tools wrote it",
                "the warm runner started by the first run forked every forced run",
                "the kept server and the runner stopped by `conveyor server stop`; nothing else left running"],
        notes=[f"forced stage: conveyor {ratio:.2f}x dvc repro -s -f (goal <= {RATIO_GOAL}x: "
               f"{met(ratio <= RATIO_GOAL)}); {seconds:.2f} s (goal <= {SECONDS_GOAL} s: "
               f"{met(seconds <= SECONDS_GOAL)})",
               f"first run of a session: conveyor {first.seconds:.2f} s (its server's start included), "
               f"dvc repro {first_dvc.seconds:.2f} s"],
    )
