"""search: what a trial of `conveyor search` costs beyond its own work, against Optuna alone.

The trial is trivial, so what is measured is the machinery. Both sides draw the same trials (the params
file's x = 0.5, then Optuna's RandomSampler, seed 1, over uniform(0, 1), minimising (x - 0.3)^2): an
ask-and-tell loop in one process (``python plain.py N``, a JournalStorage file) and `conveyor search fit`
of a task stage on one thread, N trials and 1 from a fresh copy each time: one trial costs
``(T(N) - T(1)) / (N - 1)``. Checked: N succeeded trials in conveyor's record, the same best objective on
both sides. Goal (issue 33): at most 50 ms per trial for conveyor.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.projects import Copies, base_env, make_repo, per_stage_ms, run_record, timed_cli

NAME = "search"
DESCRIPTION = "the cost of one trial of conveyor search beyond its work, vs an Optuna ask-and-tell loop alone"
TRIAL_GOAL_MS = 50.0

FIT = '''\
import json
from pathlib import Path

def write(x, model, metrics):
    for path, text in ((model, f"{x}\\n"), (metrics, json.dumps({"loss": (x - 0.3) ** 2}))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return (x - 0.3) ** 2

def fit(ctx):
    write(float(ctx.params["fit.x"]), ctx.out(), ctx.metric())
'''

PLAIN = '''\
import sys
import optuna
from optuna.distributions import FloatDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from steps.fit import write
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(storage=JournalStorage(JournalFileBackend("journal.log")),
                            sampler=optuna.samplers.RandomSampler(seed=1))
study.enqueue_trial({"x": 0.5})
for _ in range(int(sys.argv[1])):
    trial = study.ask({"x": FloatDistribution(0.0, 1.0)})
    folder = f"trials/{trial.number}"
    study.tell(trial, write(trial.params["x"], f"{folder}/models/m.txt", f"{folder}/metrics/fit.json"))
print(f"best {study.best_value!r}")
'''

SPEC = '''\
pipeline: search-bench
task_packages: [steps]
profiles: {one: {kind: threads, max_workers: 1}}
stages:
  fit: {task: steps.fit:fit, on: one, params: [fit.x], outs: [models/m.txt], metrics: [metrics/fit.json]}
'''

SEARCH = ["conveyor", "search", "fit", "--param", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:loss",
          "--sampler", "random", "--seed", "1", "--trials"]


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, repeats = 10 if config.quick else 40, config.reps(full=5, quick=2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-search-"))
    copies, env = Copies(scratch), base_env()
    best: dict[str, set[float]] = {"optuna": set(), "conveyor": set()}

    def side(name: str, size: int) -> float:
        """One run of ``size`` trials in a fresh copy, checked; its best objective kept for N trials."""
        with copies.fresh(scratch / "template", name) as workdir:
            if name == "optuna":
                done = timed_cli(["python", "plain.py", str(size)], workdir, env)
                made = len(list((workdir / "trials").iterdir()))
                check(made == size, f"Optuna alone: {made} trial folders, expected {size}")
                found = float(done.stdout.split()[-1])
            else:
                done = timed_cli([*SEARCH, str(size)], workdir, env)
                stages = run_record(workdir)["stages"]
                check(len(stages) == size and {s["status"] for s in stages.values()} == {"succeeded"},
                      f"conveyor search: the record does not hold {size} succeeded trials: {sorted(stages)}")
                found = min(s["metrics"]["loss"] for s in stages.values())
            if size == n:
                best[name].add(found)
            return done.seconds

    try:
        make_repo(scratch / "template", {"pyproject.toml": '[project]\nname = "search-bench"\nversion = "0"\n',
                                         "params.yaml": "fit:\n  x: 0.5\n", "steps/__init__.py": "",
                                         "steps/fit.py": FIT, "plain.py": PLAIN, "configs/pipeline.yaml": SPEC},
                  dvc=False)
        log(f"{NAME}: warm-up (one run of each side, not counted)")
        side("optuna", 1), side("conveyor", 1)
        log(f"{NAME}: {repeats} interleaved repetitions of {n} and 1 trial(s)")
        base, cand = interleaved(repeats, lambda _i: {"n": side("optuna", n), "1": side("optuna", 1)},
                                 lambda _i: {"n": side("conveyor", n), "1": side("conveyor", 1)}, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check(len(best["optuna"]) == 1 and best["optuna"] == best["conveyor"],
          f"the two sides found different best objectives: {best}")
    ms = [per_stage_ms([r["n"] for r in rows], [r["1"] for r in rows], n - 1) for rows in (base, cand)]
    per = Metric(f"per trial (ms), (T({n})-T(1))/{n - 1}, vs Optuna alone; goal: conveyor <= {TRIAL_GOAL_MS:g} ms",
                 ms[0], ms[1], digits=1)
    wall = Metric(f"{n} trials, wall (s), vs Optuna alone", [b["n"] for b in base], [c["n"] for c in cand])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline=f"an Optuna ask-and-tell loop of {n} trials in one process (JournalStorage file, RandomSampler)",
        candidate=f"`conveyor search fit --trials {n} --sampler random --seed 1`, a task stage on 1 thread",
        repeats=repeats, metrics=[per, wall],
        setup={"trials": f"{n} (and 1)", "best objective (both sides)": f"{best['conveyor'].pop():.6g}"},
        checks=[f"every command exited 0; conveyor's record lists {n} succeeded trials; both sides found the same best"
                " objective (the same trials drawn)"],
        notes=[f"conveyor adds {median(per.candidate) - median(per.baseline):.1f} ms a trial to Optuna's (its "
               f"folder, the stage runner, a line in the run's events file); goal conveyor <= {TRIAL_GOAL_MS:g} ms: "
               f"{met(median(per.candidate) <= TRIAL_GOAL_MS)}"],
    )
