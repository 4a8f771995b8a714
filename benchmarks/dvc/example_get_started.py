"""example-get-started: DVC's own tutorial project, forced, `conveyor run -f` vs `dvc repro -f`.

iterative/example-get-started (4 ``cmd`` stages in a chain: prepare, featurize, train, evaluate
with dvclive), a project conveyor did not write, run as it is. Its ``data/data.xml`` is a
``dvc import`` from DVC's registry, which needs the network: the benchmark replaces it with a
generated stand-in of the same shape (0.9 MB of StackOverflow-like posts, seeded), ``dvc add``ed and
committed, so that both tools run the same four stages on the same bytes.

Needs a clone of it (``git clone https://github.com/iterative/example-get-started``) named by
``CONVEYOR_BENCH_EXAMPLE_GET_STARTED``, and dvclive importable by the stages (``pip install
dvclive``). The benchmark clones that clone into a scratch folder: the user's is not touched.

One pipeline, one record: both sides force the whole chain in the same clone, alternating
(hyperfine, one run per side per repetition, B C then C B), after one first run each (not timed:
conveyor's starts its kept Prefect server and its warm runner, which the benchmark waits for).
No PREFECT_API_URL, the benchmark's own PREFECT_HOME, as on a new user's machine.

Checked: every conveyor run ran the four stages (run record), the warm runner forked every forced
run, ``dvc status`` is clean afterwards, and the kept server and the runner are stopped by
``conveyor server stop`` with nothing else left running.

Goal (issue 34): at most 1.0x `dvc repro -f`: on a chain there is nothing to run at once, so
conveyor must cost no more than DVC around the same commands.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.commands import alternating
from benchmarks.harness import Config, Metric, Result, check, met
from benchmarks.processes import wait_warm
from benchmarks.projects import check_no_leftovers, cli, no_server_env, run_record
from conveyor.cli.warm_runner import runners

NAME = "example-get-started"
DESCRIPTION = "iterative/example-get-started forced: conveyor run -f vs dvc repro -f (kept server, warm runner)"
SOURCE = "CONVEYOR_BENCH_EXAMPLE_GET_STARTED"
STAGES = ("prepare", "featurize", "train", "evaluate")
RATIO_GOAL = 1.0
WORDS = ("r", "python", "data", "frame", "plot", "ggplot", "function", "value", "list", "vector", "matrix",
         "model", "error", "code", "file", "string")


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


def make_project(source: Path, root: Path, env: dict[str, str]) -> None:
    cli(["git", "clone", "-q", str(source), str(root)], root.parent, env)
    cli(["git", "rm", "-q", "data/data.xml.dvc"], root, env)
    stand_in(root / "data" / "data.xml")
    cli(["dvc", "add", "-q", "data/data.xml"], root, env)
    cli(["git", "add", "-A"], root, env)
    cli(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "stand-in"], root, env)


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
        make_project(Path(str(source)), project, env)
        log(f"{NAME}: the first run of each side (not timed)")
        cli(["dvc", "repro"], project, env)
        cli(["conveyor", "run", "-f"], project, env)
        warm = wait_warm(home)
        log(f"{NAME}: {repeats} alternating repetitions of the forced chain")
        base, cand = alternating(["dvc", "repro", "-f"], ["conveyor", "run", "-f"], project, env, repeats)
        ran = sorted(n for n, s in run_record(project)["stages"].items() if s["status"] == "succeeded")
        check(ran == sorted(STAGES), f"conveyor run -f ran {ran}")
        served = [r.served for r in runners(home) if r.pid == warm.pid]
        check(served != [] and served[0] >= repeats, f"the forced runs were not all forked (served {served})")
        status = cli(["dvc", "status"], project, env).stdout
        check("up to date" in status, f"dvc status after both tools:\n{status}")
        cli(["conveyor", "server", "stop"], project, env)
        check_no_leftovers(home, NAME)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    forced = Metric("forced chain of 4 stages (s)", base, cand)
    ratio = forced.share()
    return Result(
        name=NAME, description=DESCRIPTION, baseline="dvc repro -f", candidate="conveyor run -f (no PREFECT_API_URL)",
        repeats=repeats, metrics=[forced],
        setup={"project": f"a clone of {source} (iterative/example-get-started), data/data.xml a generated stand-in",
               "prefect": "no PREFECT_API_URL, the benchmark's own PREFECT_HOME: the server conveyor keeps"},
        checks=["each forced conveyor run ran the four stages (run record)",
                "the warm runner started by the first run forked every forced run",
                "dvc status is clean after both tools wrote dvc.lock",
                "the kept server and the runner stopped by `conveyor server stop`; nothing else left running"],
        notes=[f"conveyor {ratio:.3f}x dvc repro -f (goal <= {RATIO_GOAL}x: {met(ratio <= RATIO_GOAL)})"],
    )
