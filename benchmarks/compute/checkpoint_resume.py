"""checkpoint-resume: `conveyor run` of a training never stopped vs the run after one killed at 60 %.

The question (issue 39): what does a checkpoint give back to a user whose training was killed
(kill -9 of `conveyor run`: a machine gone, a time limit)? A project of the reference training
stages as configs/pipeline.yaml declares them (``tasks.train:xgboost_model`` in conveyor's
process, ``tasks.train:mlp_model`` in a process of its own with ``deterministic: true``) over
synthetic HIGGS-shaped rows (``ROWS``: 2M for XGBoost, 1M for the MLP) split by
``benchmarks/compute/plain_preprocess.py`` (not timed);
params.yaml's ``train.xgb`` (500 rounds, a checkpoint every 50) and ``scale.train.mlp`` at 10
epochs (a checkpoint each epoch). No PREFECT_API_URL: the server conveyor keeps (started by a
warm-up run, stopped at the end). For each model, each repetition in a fresh copy of the project:

- baseline: `conveyor run STAGE`, the whole training;
- candidate: `conveyor run STAGE` killed with SIGKILL once the checkpoint of round 300 / epoch 6
  is marked (a ``sitecustomize`` wraps ``Checkpoint.mark``: exact, as tests/faults do; not
  timed), then `conveyor run STAGE` again, timed: it resumes.

Checked: each resumed run's record says it resumed from that step, and its model's bytes are
those of the run never killed (the same bytes on every repetition). Goal (issue 39): the
resumed run under 60 % of the whole one's wall, i.e. a ratio above 1.67x.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from benchmarks.commands import TIMEOUT_S
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, met, rows_label
from benchmarks.projects import Copies, check_no_leftovers, cli, no_server_env, run_record, timed_cli

NAME = "checkpoint-resume"
DESCRIPTION = ("conveyor run of a training never stopped vs the run after one killed at 60 % (it resumes "
               "from the checkpoint): the reference XGBoost (500 rounds) and MLP (10 epochs)")
# rows per stage: trainings long enough that what every run pays (imports, the flow, reading and
# sketching the data: about 5 s here) is not most of what a checkpoint can save
ROWS = {"train_xgb": 2_000_000, "train_mlp": 1_000_000}
QUICK_ROWS = 100_000
ROWS_PER_PART = 62_500
GOAL = 0.6  # the resumed run's wall at most this share of the whole run's
KILL_AT = {"train_xgb": 300, "train_mlp": 6}
MODEL = {"train_xgb": "models/xgb.json", "train_mlp": "models/mlp.pt"}

SPEC = """
pipeline: checkpoint-resume
stages:
  train_xgb:
    task: tasks.train:xgboost_model
    deps: [data/processed]
    params: [train.xgb, seed]
    outs: [models/xgb.json]
    metrics: [metrics/train_xgb.json]
  train_mlp:
    task: tasks.train:mlp_model
    deterministic: true
    deps: [data/processed]
    params: [train.mlp, seed]
    outs: [models/mlp.pt]
    metrics: [metrics/train_mlp.json]
"""
# SIGKILL of `conveyor run` (and of the process that marked, when it is another) once a checkpoint
# of KILL_AT_STEP is marked: what a machine going down does
KILLER = '''
import os, signal
if os.environ.get("KILL_AT_STEP"):
    import conveyor.run.checkpoints as _checkpoints

    _mark = _checkpoints.Checkpoint.mark

    def _mark_then_die(self, step, *args, **kwargs):
        _mark(self, step, *args, **kwargs)
        if step >= int(os.environ["KILL_AT_STEP"]):
            import psutil

            for parent in psutil.Process().parents():
                if "conveyor" in " ".join(parent.cmdline()[:2]) and "run" in parent.cmdline()[1:3]:
                    os.kill(parent.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    _checkpoints.Checkpoint.mark = _mark_then_die
'''


def make_project(root: Path, rows: int) -> None:
    """The two training stages, their params, and ``rows`` rows split into data/processed."""
    from benchmarks.compute.plain_preprocess import preprocess
    from benchmarks.compute.preprocess_workers import generate

    reference = yaml.safe_load((REPO / "params.yaml").read_text())
    params = {"seed": reference["seed"], "train": {
        "xgb": reference["train"]["xgb"],
        "mlp": {**reference["scale"]["train"]["mlp"], "max_epochs": 10, "patience": 10}}}
    (root / "configs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'resume'\n")
    (root / "configs/pipeline.yaml").write_text(SPEC.lstrip())
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    generate(root / "raw", rows, max(1, rows // ROWS_PER_PART))
    preprocess(root / "raw", root / "data/processed", label="target", seed=int(params["seed"]))
    shutil.rmtree(root / "raw")


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-resume-"))
    home, killer = scratch / "prefect-home", scratch / "killer"
    home.mkdir()
    killer.mkdir()
    (killer / "sitecustomize.py").write_text(KILLER)
    env = {**no_server_env(home), "PYTHONPATH": str(REPO)}  # tasks.train: the reference tasks
    copies = Copies(scratch)
    models: dict[str, bytes] = {}
    metrics: list[Metric] = []
    try:
        rows = {stage: QUICK_ROWS if config.quick else n for stage, n in ROWS.items()}
        templates = {stage: scratch / f"project-{n}" for stage, n in rows.items()}
        for n in sorted(set(rows.values())):
            log(f"{NAME}: generating and preprocessing {n:,} synthetic rows (not timed)")
            make_project(scratch / f"project-{n}", n)
        with copies.fresh(templates["train_xgb"], "warm-up") as warm:  # starts the kept server: neither side pays it
            cli(["conveyor", "validate"], warm, env)
            cli(["conveyor", "run", "train_xgb"], warm, env)

        def whole(stage: str, _repetition: int) -> tuple[float, float]:
            with copies.fresh(templates[stage], "whole") as project:
                seconds = timed_cli(["conveyor", "run", stage], project, env).seconds
                _same_model(models, stage, project, "the run never killed")
                return seconds, float(run_record(project)["stages"][stage]["duration_s"])

        def resumed(stage: str, _repetition: int) -> tuple[float, float]:
            with copies.fresh(templates[stage], "resumed") as project:
                killed = {**env, "PYTHONPATH": f"{killer}:{REPO}", "KILL_AT_STEP": str(KILL_AT[stage])}
                done = subprocess.run(["conveyor", "run", stage], cwd=project, env=killed, capture_output=True,
                                      text=True, timeout=TIMEOUT_S)
                check(done.returncode == -signal.SIGKILL and not (project / MODEL[stage]).exists(),
                      f"{stage}: the run to kill at step {KILL_AT[stage]} exited {done.returncode}:\n"
                      f"{done.stderr[-2000:]}")
                seconds = timed_cli(["conveyor", "run", stage], project, env).seconds
                record = run_record(project)["stages"][stage]
                resumed_from = record.get("resumed") or {}
                check(resumed_from.get("step") == KILL_AT[stage],
                      f"{stage}: the run after the kill did not resume from step {KILL_AT[stage]}: {resumed_from}")
                _same_model(models, stage, project, "the resumed run")
                return seconds, float(record["duration_s"])

        for stage, label in (("train_xgb", "XGBoost, 500 rounds"), ("train_mlp", "MLP, 10 epochs")):
            log(f"{NAME}: {stage}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, partial(whole, stage), partial(resumed, stage), log)
            what = f"{label}, {rows_label(rows[stage])} rows"
            metrics.append(Metric(f"{what}: wall of `conveyor run` (s)", [b[0] for b in base], [c[0] for c in cand]))
            metrics.append(Metric(f"{what}: wall of the stage (s; the run record)", [b[1] for b in base],
                                  [c[1] for c in cand]))
        cli(["conveyor", "server", "stop"], templates["train_xgb"], env)
        check_no_leftovers(home, "the runs")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    shares = {m.label: m.share() for m in metrics}
    return Result(
        name=NAME, description=DESCRIPTION, baseline="conveyor run STAGE, never stopped",
        candidate="conveyor run STAGE after a run killed (SIGKILL) at round 300 / epoch 6: resumed",
        repeats=repeats, metrics=metrics,
        setup={"data": "synthetic HIGGS-shaped rows (" + ", ".join(f"{stage} {n:,}" for stage, n in rows.items())
                       + ") split by benchmarks/compute/plain_preprocess.py",
               "stages": "tasks.train:xgboost_model in conveyor's process (every core), tasks.train:mlp_model in "
                         "a process of its own (deterministic: true, one thread)",
               "prefect": "no PREFECT_API_URL: the server conveyor keeps, started by a warm-up run"},
        checks=["each resumed run's record says it resumed from round 300 / epoch 6",
                "every run's model has the same bytes as the first run never killed",
                "the kept server stopped by `conveyor server stop`; nothing left running"],
        notes=[f"goal (issue 39): the resumed run under {GOAL:.0%} of the whole run's wall: " + "; ".join(
            f"{label.split(',')[0]}, {label.split(': wall of ')[1].split(' (')[0]}: {share:.0%} ({met(share < GOAL)})"
            for label, share in shares.items()),
            "what every run pays whether it resumes or not (the command's imports and flow, about 2 s; reading the "
            "splits and xgboost's quantile sketch, in proportion to the rows) keeps the share above the 40 % of "
            "the work left; resuming XGBoost also predicts the saved trees once on the training and valid rows"],
    )


def _same_model(models: dict[str, bytes], stage: str, project: Path, what: str) -> None:
    got = (project / MODEL[stage]).read_bytes()
    models.setdefault(stage, got)
    check(got == models[stage], f"{stage}: {what} wrote other model bytes than the first run never killed")
