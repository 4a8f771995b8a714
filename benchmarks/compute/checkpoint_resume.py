"""checkpoint-resume: `conveyor run` of a training never stopped vs the run after one killed at 60 %.

The reference training stages on synthetic splits, the kept server up, each run in a fresh copy; the candidate runs
after one SIGKILLed at round 300 / epoch 6 (``KILLER``, not timed). Goal (issue 39): under 60 % of the whole run's wall.
Checked: it resumed from that step, every model has the first whole run's bytes, nothing left running.
"""

import signal
import subprocess
from collections.abc import Callable
from functools import partial

import yaml

from benchmarks.commands import TIMEOUT_S
from benchmarks.compute.torch_ddp import make_splits, mlp_params, reference
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, met, rows_label, scratch
from benchmarks.projects import Copies, check_no_leftovers, cli, no_server_env, run_record, timed_cli

NAME = "checkpoint-resume"
DESCRIPTION = ("conveyor run of a training never stopped vs the run after one killed at 60 % (it resumes "
               "from the checkpoint): the reference XGBoost (500 rounds) and MLP (10 epochs)")
ROWS, QUICK_ROWS = {"train_xgb": 2_000_000, "train_mlp": 1_000_000}, 100_000  # long enough to matter
GOAL = 0.6  # the resumed run's wall at most this share of the whole run's
KILL_AT, MODEL = {"train_xgb": 300, "train_mlp": 6}, {"train_xgb": "models/xgb.json", "train_mlp": "models/mlp.pt"}
LABEL = {"train_xgb": "XGBoost, 500 rounds", "train_mlp": "MLP, 10 epochs"}
# a sitecustomize: SIGKILL `conveyor run` (and the marking process) once a checkpoint of KILL_AT_STEP is marked
KILLER = '''import os, signal
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


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats, models, metrics = config.reps(full=3, quick=1), dict[str, bytes](), list[Metric]()
    rows = {stage: QUICK_ROWS if config.quick else n for stage, n in ROWS.items()}
    with scratch("resume") as root:
        (root / "sitecustomize.py").write_text(KILLER)
        env, copies = {**no_server_env(root / "prefect-home"), "PYTHONPATH": str(REPO)}, Copies(root)

        def one(stage: str, kill: bool, _repetition: int) -> tuple[float, float]:
            with copies.fresh(root / f"project-{rows[stage]}", "resumed" if kill else "whole") as project:
                if kill:  # root's sitecustomize.py on PYTHONPATH
                    done = subprocess.run(["conveyor", "run", stage], cwd=project, capture_output=True, text=True, env={
                        **env, "PYTHONPATH": f"{root}:{REPO}", "KILL_AT_STEP": str(KILL_AT[stage])}, timeout=TIMEOUT_S)
                    check(done.returncode == -signal.SIGKILL and not (project / MODEL[stage]).exists(), f"{stage}: "
                          f"the run to kill at step {KILL_AT[stage]} exited {done.returncode}:\n{done.stderr[-2000:]}")
                seconds = timed_cli(["conveyor", "run", stage], project, env).seconds
                record = run_record(project)["stages"][stage]
                check(not kill or (record.get("resumed") or {}).get("step") == KILL_AT[stage], f"{stage}: the run "
                      f"after the kill did not resume from step {KILL_AT[stage]}: {record.get('resumed')}")
                model = (project / MODEL[stage]).read_bytes()
                check(models.setdefault(stage, model) == model, f"{stage}: the {('whole', 'resumed')[kill]} run wrote "
                      "other model bytes than the first run never killed")
                return seconds, float(record["duration_s"])

        params = {"seed": reference()["seed"], "train": {"xgb": reference()["train"]["xgb"], "mlp": mlp_params(10)[0]}}
        spec = {"pipeline": NAME, "stages": {
            stage: {"task": f"tasks.train:{task}", **({"deterministic": True} if kind == "mlp" else {}),
                    "deps": ["data/processed"], "params": [f"train.{kind}", "seed"], "outs": [MODEL[stage]],
                    "metrics": [f"metrics/{stage}.json"]}
            for stage, task, kind in (("train_xgb", "xgboost_model", "xgb"), ("train_mlp", "mlp_model", "mlp"))}}
        for n in sorted(set(rows.values())):
            log(f"{NAME}: generating and preprocessing {n:,} synthetic rows (not timed)")
            (project := root / f"project-{n}").joinpath("configs").mkdir(parents=True)
            (project / "configs/pipeline.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
            (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            (project / "pyproject.toml").write_text("[project]\nname = 'resume'\n")
            make_splits(project, n, project / "data/processed", plain=True)
        with copies.fresh(root / f"project-{rows['train_xgb']}", "warm-up") as warm:  # starts the kept server
            cli(["conveyor", "validate"], warm, env)
            cli(["conveyor", "run", "train_xgb"], warm, env)
        for stage in ROWS:
            log(f"{NAME}: {stage}: {repeats} interleaved repetitions")
            base, cand = interleaved(repeats, partial(one, stage, False), partial(one, stage, True), log)
            metrics += [Metric(f"{LABEL[stage]}, {rows_label(rows[stage])} rows: wall of {what}",
                               [b[k] for b in base], [c[k] for c in cand])
                        for k, what in enumerate(("`conveyor run` (s)", "the stage (s; the run record)"))]
        cli(["conveyor", "server", "stop"], root / f"project-{rows['train_xgb']}", env)
        check_no_leftovers(root / "prefect-home", "the runs")
    shares = "; ".join(f"{m.label.split(',')[0]}, {m.label.split(': wall of ')[1].split(' (')[0]}: {m.share():.0%} "
                       f"({met(m.share() < GOAL)})" for m in metrics)
    return Result(
        name=NAME, description=DESCRIPTION, baseline="conveyor run STAGE, never stopped",
        candidate="conveyor run STAGE after a run killed (SIGKILL) at round 300 / epoch 6: resumed",
        repeats=repeats, metrics=metrics, setup={"rows": str(rows)},
        notes=[f"goal (issue 39): the resumed run under {GOAL:.0%} of the whole run's wall: {shares}"])
