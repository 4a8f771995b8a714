"""edit-run: the edit-run loop as a new user meets it, no PREFECT_API_URL: forcing one trivial stage.

Three ``echo`` stages (git + DVC): the session's first run (conveyor's starts its kept Prefect server), then, once the
warm runner serves, `-s -f report` of each alternating. Checked: each ran exactly ``report``, dvc.lock holds the three
stages, the warm runner forked every forced run, nothing is left after `conveyor server stop`.
"""

from collections.abc import Callable

import yaml

from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, median, met, scratch
from benchmarks.processes import wait_warm
from benchmarks.projects import base_env, check_no_leftovers, cli, make_repo, no_server_env, run_record, timed_cli
from conveyor.cli.warm_state import runners

NAME = "edit-run"
DESCRIPTION = ("the edit-run loop with no PREFECT_API_URL: conveyor run -s -f STAGE vs dvc repro -s -f STAGE "
               "after a first run (the kept Prefect server, the warm runner); the first run of a session as it is")
RATIO_GOAL, SECONDS_GOAL = 1.5, 1.5  # issue 34
DVC_YAML = """stages:
  prepare: {cmd: echo prepared > prepared.txt, outs: [prepared.txt]}
  train: {cmd: cat prepared.txt > model.txt && echo trained >> model.txt, deps: [prepared.txt], outs: [model.txt]}
  report: {cmd: wc -l model.txt > report.txt, deps: [model.txt], outs: [report.txt]}
"""


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=7, quick=3)
    with scratch(NAME) as tmp:
        (home := tmp / "prefect-home").mkdir()
        env, project, twin = no_server_env(home), tmp / "project", tmp / "twin"
        for root in (project, twin):
            make_repo(root, {"dvc.yaml": DVC_YAML}, dvc=True)
        log(f"{NAME}: the first run of the session (it starts the kept Prefect server)")
        peer, first = timed_cli(["dvc", "repro"], twin, base_env()), timed_cli(["conveyor", "run"], project, env)
        check(run_record(project)["status"] == "succeeded", "the first conveyor run did not succeed")
        status = cli(["conveyor", "server", "status"], project, env).stdout
        check("url:" in status, f"no Prefect server kept after the first run:\n{status}")
        warm = wait_warm(home)  # as a user's next edit comes seconds later
        base, cand = alternating(["dvc", "repro", "-s", "-f", "report"], ["conveyor", "run", "-s", "-f", "report"],
                                 project, env, repeats)
        ran = sorted(name for name, s in run_record(project)["stages"].items() if s["status"] == "succeeded")
        check(ran == ["report"], f"conveyor run -s -f report ran {ran}")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the warm runner did not fork every forced run ({served})")
        lock = yaml.safe_load((project / "dvc.lock").read_text())
        check(set(lock["stages"]) == {"prepare", "train", "report"}, f"dvc.lock holds {sorted(lock['stages'])}")
        cli(["conveyor", "server", "stop"], project, env)
        check_no_leftovers(home, "the edit-run loop")
    forced = Metric("forced one trivial stage after the first run (s)", base, cand)
    ratio, seconds = forced.share(), median(cand)
    return Result(NAME, DESCRIPTION, "dvc repro", "conveyor run (no PREFECT_API_URL)", repeats, [forced, Metric(
        "first run of a session, 3 stages (s; conveyor starts its Prefect server)", [peer.seconds], [first.seconds])],
                  notes=[f"forced stage: conveyor {ratio:.2f}x dvc repro -s -f (goal <= {RATIO_GOAL}x: "
                         f"{met(ratio <= RATIO_GOAL)}); {seconds:.2f} s (goal <= {SECONDS_GOAL} s: "
                         f"{met(seconds <= SECONDS_GOAL)})"])
