"""search: what a trial of `conveyor search` costs beyond its own work, against Optuna alone.

The same trivial trials on both sides (x = 0.5, then RandomSampler seed 1, minimising (x - 0.3)^2), N and 1 of them
from a fresh copy each time, a trial costing ``(T(N) - T(1)) / (N - 1)``. Checked: N succeeded trials in conveyor's
record, the same best objective on both sides.
"""

from collections.abc import Callable
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.processes import leftovers
from benchmarks.projects import Copies, make_repo, no_server_env, per_stage_ms, run_record, timed_cli

NAME = "search"
DESCRIPTION = "the cost of one trial of conveyor search beyond its work, vs an Optuna ask-and-tell loop alone"
TRIAL_GOAL_MS = 50.0  # issue 33
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
import sys, optuna, optuna.storages.journal
from steps.fit import write
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
    "journal.log")), sampler=optuna.samplers.RandomSampler(seed=1))
study.enqueue_trial({"x": 0.5})
for _ in range(int(sys.argv[1])):
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    folder = f"trials/{trial.number}"
    study.tell(trial, write(trial.params["x"], f"{folder}/models/m.txt", f"{folder}/metrics/fit.json"))
print(f"best {study.best_value!r}")
'''
SPEC = ("pipeline: search-bench\ntask_packages: [steps]\nprofiles: {one: {kind: threads, max_workers: 1}}\nstages:\n"
        "  fit: {task: steps.fit:fit, on: one, params: [fit.x], outs: [models/m.txt], metrics: [metrics/fit.json]}\n")
SEARCH = ["conveyor", "search", "fit", "--param", "fit.x=uniform(0,1)", "--objective", "metrics/fit.json:loss",
          "--sampler", "random", "--seed", "1", "--trials"]


def run(config: Config, log: Callable[[str], None]) -> Result:
    n, repeats = 10 if config.quick else 40, config.reps(full=5, quick=2)
    best: dict[str, set[float]] = {"optuna": set(), "conveyor": set()}
    with scratch(NAME) as tmp:
        copies, env = Copies(tmp), no_server_env(tmp / "prefect-home")  # not the user's: a server kept there
        make_repo(tmp / "template", {"pyproject.toml": '[project]\nname = "search-bench"\nversion = "0"\n',
                                     "params.yaml": "fit:\n  x: 0.5\n", "steps/__init__.py": "", "steps/fit.py": FIT,
                                     "plain.py": PLAIN, "configs/pipeline.yaml": SPEC}, dvc=False)

        def side(name: str, size: int) -> float:
            with copies.fresh(tmp / "template", name) as workdir:
                optuna = name == "optuna"
                done = timed_cli(["python", "plain.py", str(size)] if optuna else [*SEARCH, str(size)], workdir, env)
                trials: list[Any] = list((workdir / "trials").iterdir() if optuna
                                         else run_record(workdir)["stages"].values())
                check(len(trials) == size and (optuna or {s["status"] for s in trials} == {"succeeded"}),
                      f"{name}: {len(trials)} trials (all succeeded?), expected {size}")
                if size == n:
                    best[name].add(float(done.stdout.split()[-1]) if optuna else min(s["metrics"]["loss"]
                                                                                     for s in trials))
                return done.seconds
        side("optuna", 1), side("conveyor", 1)
        base, cand = interleaved(repeats, lambda _i: {k: side("optuna", k) for k in (n, 1)},
                                 lambda _i: {k: side("conveyor", k) for k in (n, 1)}, log)
        check(not leftovers(tmp / "prefect-home"), "conveyor search left processes")  # ends the server it kept
    check(len(best["optuna"]) == 1 and best["optuna"] == best["conveyor"],
          f"the two sides found different best objectives: {best}")
    ms = [per_stage_ms([r[n] for r in rows], [r[1] for r in rows], n - 1) for rows in (base, cand)]
    per = Metric(f"per trial (ms), (T({n})-T(1))/{n - 1}, vs Optuna alone; goal: conveyor <= {TRIAL_GOAL_MS:g} ms",
                 ms[0], ms[1], digits=1)
    return Result(
        NAME, DESCRIPTION, f"an Optuna ask-and-tell loop of {n} trials in one process (JournalStorage file, "
        "RandomSampler)", f"`conveyor search fit --trials {n} --sampler random --seed 1`, a task stage on 1 thread",
        repeats, [per, Metric(f"{n} trials, wall (s), vs Optuna alone", [b[n] for b in base], [c[n] for c in cand])],
        notes=[f"goal conveyor <= {TRIAL_GOAL_MS:g} ms a trial: {median(per.candidate):.1f} ms, "
               f"{met(median(per.candidate) <= TRIAL_GOAL_MS)}"])
