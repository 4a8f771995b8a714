"""deterministic: the reference MLP trained with the pinned kernel paths vs with the machine's own.

What ``deterministic: true`` costs (issue 35): ``tasks.train:mlp_model`` with ``train.mlp`` on the reference splits in a
fresh process, in this environment vs with ``pinned_environ`` over it. Goal: at most 1.3x the training wall. Checked:
each side wrote the same weights every repetition, the pinned one with torch's DEFAULT kernels and 1 thread.
"""

import sys
from collections.abc import Callable
from functools import partial

from benchmarks.compute.torch_ddp import measure, reference
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.projects import cli, repo_env

NAME = "deterministic"
DESCRIPTION = "the reference MLP with deterministic: true's pinned kernels and one thread vs the machine's own"
GOAL = 1.3  # the candidate's training wall at most this many times the baseline's


def run(config: Config, log: Callable[[str], None]) -> Result:
    from conveyor.run.determinism import pinned_environ

    repeats, machine, params = config.reps(7, 2), repo_env(), reference()
    with scratch(NAME) as tmp:
        log(f"{NAME}: the reference data's splits (benchmarks/overhead/plain_reference.py, not timed)")
        cli([sys.executable, str(REPO / "benchmarks/overhead/plain_reference.py"), str(tmp / "plain")], REPO, machine)
        train = partial(measure, "train_mlp", {"train.mlp": params["train"]["mlp"], "seed": params["seed"]},
                        tmp / "plain/data/processed")
        base, cand = interleaved(repeats, partial(train, env=machine),
                                 partial(train, env=machine | pinned_environ(machine)), log)
    for name, done in (("machine", base), ("pinned", cand)):
        check(len({r.report["sha256"] for r in done}) == 1, f"{name}: other weights on another repetition")
    own, pinned = base[0].report, cand[0].report
    check(pinned["capability"] == "DEFAULT" and pinned["threads"] == [1],
          f"the pinned side ran {pinned['capability']} with {pinned['threads']} threads")
    wall = Metric("training wall (s), mlp_model(ctx)", [r.seconds for r in base], [r.seconds for r in cand], digits=3)
    ratio = median(wall.candidate) / median(wall.baseline)
    return Result(
        name=NAME, description=DESCRIPTION, repeats=repeats,
        metrics=[wall, Metric("process wall (s), interpreter and imports included", [r.wall for r in base],
                               [r.wall for r in cand])],
        baseline=f"the machine's kernels: torch {own['capability']}, {own['threads'][0]} threads",
        candidate="pinned_environ: torch DEFAULT, MKL_CBWR=COMPATIBLE, OpenBLAS Prescott, NumPy's baseline, 1 thread",
        notes=[f"goal: pinned training at most {GOAL}x the machine's: {ratio:.2f}x ({met(ratio <= GOAL)})"])
