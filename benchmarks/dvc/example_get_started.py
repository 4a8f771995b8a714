"""example-get-started: DVC's own tutorial project, forced, `conveyor run -f` vs `dvc repro -f`.

iterative/example-get-started (4 ``cmd`` stages in a chain, evaluate logging with dvclive), run as it is,
from a clone named by ``CONVEYOR_BENCH_EXAMPLE_GET_STARTED`` (cloned again into a scratch folder; dvclive
must be importable). Its ``data/data.xml``, a ``dvc import`` that needs the network, is replaced by a seeded
0.9 MB stand-in of the same shape, ``dvc add``ed and committed. Both sides force the chain in the same clone,
alternating (hyperfine), after one untimed first run each (conveyor's starts its kept server and warm
runner); no PREFECT_API_URL. Checked: each conveyor run ran the four stages, the warm runner forked every
forced run, ``dvc status`` is clean, and `conveyor server stop` leaves nothing running. Goal (issue 34):
at most 1.0x `dvc repro -f`.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.commands import alternating
from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, met
from benchmarks.processes import wait_warm
from benchmarks.projects import check_no_leftovers, check_record, cli, commit, no_server_env, run_record
from conveyor.cli.warm_runner import runners

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
        i = 0
        while f.tell() < size:
            i += 1
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
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-egs-"))
    home, project = scratch / "prefect-home", scratch / "project"
    home.mkdir()
    env = no_server_env(home)
    try:
        cli(["python", "-c", "import dvclive"], scratch, env)  # its stages log with dvclive: pip install dvclive
        cli(["git", "clone", "-q", str(source), str(project)], scratch, env)
        cli(["git", "rm", "-q", "data/data.xml.dvc"], project, env)
        stand_in(project / "data" / "data.xml")
        cli(["dvc", "add", "-q", "data/data.xml"], project, env)
        commit(project, "stand-in")
        log(f"{NAME}: the first run of each side (not timed)")
        cli(["dvc", "repro"], project, env)
        cli(["conveyor", "run", "-f"], project, env)
        warm = wait_warm(home)
        log(f"{NAME}: {repeats} alternating repetitions of the forced chain")
        base, cand = alternating(["dvc", "repro", "-f"], ["conveyor", "run", "-f"], project, env, repeats)
        check_record(run_record(project), STAGES, "succeeded", "conveyor run -f")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the forced runs were not all forked (served {served})")
        dvc_status(project, env, "after both tools")
        cli(["conveyor", "server", "stop"], project, env)
        check_no_leftovers(home, NAME)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    forced = Metric("forced chain of 4 stages (s)", base, cand)
    return Result(
        name=NAME, description=DESCRIPTION, baseline="dvc repro -f", candidate="conveyor run -f (no PREFECT_API_URL)",
        repeats=repeats, metrics=[forced],
        setup={"project": f"a clone of {source} (iterative/example-get-started), data/data.xml a generated stand-in",
               "prefect": "no PREFECT_API_URL, the benchmark's own PREFECT_HOME: the server conveyor keeps"},
        checks=["each forced conveyor run ran the four stages (run record)",
                "the warm runner started by the first run forked every forced run",
                "dvc status is clean after both tools wrote dvc.lock",
                "the kept server and the runner stopped by `conveyor server stop`; nothing else left running"],
        notes=[f"conveyor {forced.share():.3f}x dvc repro -f (goal <= {RATIO_GOAL}x: "
               f"{met(forced.share() <= RATIO_GOAL)})"],
    )
