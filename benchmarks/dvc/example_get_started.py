"""example-get-started: DVC's own tutorial project, forced, `conveyor run -f` vs `dvc repro -f`.

The clone ``CONVEYOR_BENCH_EXAMPLE_GET_STARTED`` names (4 stages in a chain; dvclive importable), ``data/data.xml`` a
seeded stand-in, both sides alternating in it after a first run each; no PREFECT_API_URL. Goal (issue 34): <= 1.0x.
Checked: conveyor ran the 4 stages, its warm runner forked every run, `dvc status` clean, nothing left running."""

import itertools
import os
import random
from collections.abc import Callable
from pathlib import Path

from benchmarks.commands import alternating
from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, met, scratch
from benchmarks.processes import wait_warm
from benchmarks.projects import check_no_leftovers, check_record, cli, commit, no_server_env, run_record
from conveyor.cli.warm_state import runners

NAME = "example-get-started"
DESCRIPTION = "iterative/example-get-started forced: conveyor run -f vs dvc repro -f (kept server, warm runner)"
SOURCE = "CONVEYOR_BENCH_EXAMPLE_GET_STARTED"
STAGES = ("prepare", "featurize", "train", "evaluate")
RATIO_GOAL = 1.0
WORDS = ("r", "python", "data", "frame", "plot", "ggplot", "function", "value", "list", "vector", "matrix", "model",
         "error", "code", "file", "string")


def stand_in(path: Path, size: int = 900_000) -> None:
    """Posts in the shape of the registry's data.xml: rows with Id, Tags, Title and Body, a third tagged R."""
    rng = random.Random(7)
    with path.open("w") as f:
        f.write('<?xml version="1.0" encoding="utf-8"?>\n<posts>\n')
        for i in itertools.takewhile(lambda _: f.tell() < size, itertools.count(1)):
            tags = "&lt;r&gt;&lt;ggplot2&gt;" if rng.random() < 0.3 else "&lt;python&gt;&lt;pandas&gt;"
            title, body = (" ".join(rng.choice(WORDS) for _ in range(n)) for n in (8, 40))
            f.write(f'  <row Id="{i}" Tags="{tags}" Title="{title}" Body="&lt;p&gt;{body}&lt;/p&gt;" />\n')
        f.write("</posts>\n")


def run(config: Config, log: Callable[[str], None]) -> Result:
    source = os.environ.get(SOURCE)
    check(bool(source) and Path(str(source), "dvc.yaml").is_file(),
          f"set {SOURCE} to a clone of iterative/example-get-started "
          f"(git clone https://github.com/iterative/example-get-started)")
    repeats = config.reps(full=7, quick=3)
    with scratch("egs") as folder:
        home, project = folder / "prefect-home", folder / "project"
        home.mkdir()
        env = no_server_env(home)
        cli(["python", "-c", "import dvclive"], folder, env)  # its stages log with dvclive: pip install dvclive
        cli(["git", "clone", "-q", str(source), str(project)], folder, env)
        cli(["git", "rm", "-q", "data/data.xml.dvc"], project, env)
        stand_in(project / "data" / "data.xml")
        cli(["dvc", "add", "-q", "data/data.xml"], project, env)
        commit(project, "stand-in")
        for args in (["dvc", "repro"], ["conveyor", "run", "-f"]):  # the first run of each side, not timed
            cli(args, project, env)
        warm = wait_warm(home)
        base, cand = alternating(["dvc", "repro", "-f"], ["conveyor", "run", "-f"], project, env, repeats)
        check_record(run_record(project), STAGES, "succeeded", "conveyor run -f")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the forced runs were not all forked (served {served})")
        dvc_status(project, env, "after both tools")
        cli(["conveyor", "server", "stop"], project, env)
        check_no_leftovers(home, NAME)
    forced = Metric("forced chain of 4 stages (s)", base, cand)
    return Result(name=NAME, description=DESCRIPTION, baseline="dvc repro -f",
                  candidate="conveyor run -f (no PREFECT_API_URL)", repeats=repeats, metrics=[forced],
                  setup={"clone": str(source)}, notes=[f"conveyor {forced.share():.3f}x dvc repro -f (goal <= "
                                                       f"{RATIO_GOAL}x: {met(forced.share() <= RATIO_GOAL)})"])
