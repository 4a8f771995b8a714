"""``conveyor search STAGE``: trials proposed by Optuna, run on the stage's profile, ranked.

The summary ranks every trial of the study, each with the ``conveyor run -S ...`` line that
reproduces it in the project (the trial's params written into params.yaml, as ``-S`` does,
and the stage run there); the run record holds the trials as items (``compare`` ranks them).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import typer

from conveyor.cli import signals
from conveyor.cli.common import ProfileOption, SpecOption, app, complete_stages, err, out, profile_swaps, project_of
from conveyor.errors import UsageError, did_you_mean
from conveyor.spec.search import SAMPLERS, Search, check_search, parse_dimension, parse_objective

if TYPE_CHECKING:
    from conveyor.run.context import StageProgress
    from conveyor.run.record import StageRecord
    from conveyor.run.search import Outcomes
    from conveyor.spec.project import Project


@app.command()
def search(
    stage: Annotated[str, typer.Argument(metavar="STAGE", autocompletion=complete_stages, hidden=True)],
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", metavar="KEY=KIND(ARGS)",
        help="A param to search: uniform(LOW,HIGH), loguniform(LOW,HIGH), int(LOW,HIGH) or choice(A,B,...); "
             "e.g. 'train.alpha=loguniform(1e-4,10)'. Repeatable.")] = None,
    objective: Annotated[str, typer.Option(
        "--objective", metavar="FILE:KEY", help="The number to optimise: KEY of one of the stage's "
                                                "metrics files, e.g. metrics/train.json:rmse.")] = "",
    maximize: Annotated[bool, typer.Option(
        "--maximize/--minimize", help="Whether a higher objective is better (default: lower is).")] = False,
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Stop when the study has this many finished trials (run again, it continues).")] = 16,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", metavar="SECONDS", min=0, help="Start no trial after this long (running ones finish).")] = None,
    sampler: Annotated[str, typer.Option(
        "--sampler", metavar="NAME", help="tpe (default), random, or grid (int and choice params only).")] = "tpe",
    seed: Annotated[int | None, typer.Option("--seed", help="The sampler's seed, for a search that "
                                                            "proposes the same trials again.")] = None,
    prune: Annotated[bool, typer.Option(
        "--prune", help="Stop trials whose ctx.report(step, value) falls behind the earlier trials' "
                        "(Optuna's MedianPruner; tasks that report only).")] = False,
    profile: ProfileOption = None,
    config: SpecOption = None,
) -> None:
    """Search a stage's params with Optuna: trials run on its profile, the best printed with its `run -S` line."""
    project = project_of(config)
    if sampler not in SAMPLERS:
        raise UsageError(f"--sampler {sampler}: unknown sampler{did_you_mean(sampler, SAMPLERS)} "
                         f"(samplers: {', '.join(SAMPLERS)})")
    if not objective:
        raise UsageError("say what to optimise with --objective FILE:KEY (e.g. --objective metrics/train.json:rmse)")
    wanted = Search(stage, tuple(parse_dimension(p) for p in param or []),
                    parse_objective(objective, minimize=not maximize), sampler, trials, timeout, seed,
                    prune)
    check_search(project, wanted)
    swaps = profile_swaps(profile or [])
    from conveyor.run.profiles import Profiles

    Profiles(project.pipeline.profiles, swaps)  # unknown profile names: exit 2 before any trial
    from conveyor.run.checkpoints import limit

    limit()  # a bad CONVEYOR_CHECKPOINTS_MAX, likewise
    from conveyor.cli.warm_task import hand_tasks_over

    hand_tasks_over()  # deterministic tasks: forked by a warm runner of their pins
    try:  # an extra: `pip install -e .[cpu]` has no Optuna (imported anyway by the search)
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError("conveyor search proposes trials with Optuna, which is not installed here: "
                         "pip install 'conveyor[search]' (or pip install optuna)") from None
    from conveyor.run.record import new_run_id
    from conveyor.run.search import run_search

    warn = partial(err.print, style="yellow", highlight=False, soft_wrap=True)
    outcomes = run_search(project, wanted, new_run_id(), _View(), swaps=swaps, heard=_heard, warn=warn)
    out.print(summary(project, wanted, outcomes), highlight=False, markup=False, crop=False, soft_wrap=True)
    if outcomes.stopped is not None:
        _stopped(project, wanted, outcomes)
    if outcomes.trials and all(t.value is None and not t.pruned for t in outcomes.trials):
        from conveyor.run.trials import trial_name

        first = trial_name(wanted.stage, outcomes.trials[0].number)
        err.print(f"every trial failed: see why in its log (conveyor logs {first})", style="red", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(1)


def summary(project: Project, search: Search, outcomes: Outcomes) -> str:
    """What the search found: every trial of its study ranked, each with the command that reproduces it."""
    from conveyor.run.record import record_path
    from conveyor.run.search import metric_key
    from conveyor.run.trials import study_dir, trial_name

    ranked = outcomes.ranked(search.objective.minimize)
    key = metric_key(project, search)
    ran = len(outcomes.trials) - outcomes.already
    lines = [f"search {search.stage}: {len(outcomes.trials)} trial(s) of study {search.study} "
             f"({ran} this run), {'minimising' if search.objective.minimize else 'maximising'} "
             f"{search.objective.shown}"]
    for rank, trial in enumerate(ranked, 1):
        name = trial_name(search.stage, trial.number)
        if trial.value is None:
            lines.append(f"  -   {name}  {trial.error if trial.pruned else f'failed: {trial.error}'}")
        else:
            lines.append(f"  {rank:<3} {name}  {key} {trial.value:.6g}  {rerun(project, search, trial.values)}")
    best = ranked[0] if ranked and ranked[0].value is not None else None
    if best is not None:
        lines.append(f"best: {trial_name(search.stage, best.number)} ({key} {best.value:.6g}); reproduce it "
                     f"in the project with: {rerun(project, search, best.values)}")
    folder = project.rel(study_dir(project.root, search.study))
    record = f"; record: {project.rel(record_path(project.root, outcomes.run.run_id))}" if ran else ""
    lines.append(f"trials: {folder}/trial-<n>/ (outs, metrics, params); logs: conveyor logs "
                 f"{trial_name(search.stage, 0)[:-1]}<n>{record}")
    return "\n".join(lines)


def rerun(project: Project, search: Search, values: Mapping[str, Any]) -> str:
    """``conveyor run -S key=value ... STAGE``: the trial's values as -S reads them back exactly
    (a float as its shortest exact text), and the stage with what it needs."""
    sets = " ".join(f"-S {shlex.quote(f'{key}={_text(value)}')}" for key, value in values.items())
    return f"conveyor run{project.spec_option} {sets} {search.stage}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # floats: repr, exact when read back


def _heard(name: str, record: StageRecord) -> None:
    """A line on stderr as each trial ends: the terminal follows the search; stdout keeps its summary."""
    if record.status == "succeeded":
        numbers = "  ".join(f"{k} {v:.6g}" for k, v in record.metrics.items())
        err.print(f"{name} succeeded in {record.duration_s:.1f}s: {numbers}", highlight=False, soft_wrap=True)
    elif record.status == "pruned":
        err.print(f"{name} {record.error}", highlight=False, soft_wrap=True)
    else:
        err.print(f"{name} {record.status}: {record.error}", style="yellow", highlight=False, soft_wrap=True)


def _stopped(project: Project, search: Search, outcomes: Outcomes) -> None:
    from conveyor.errors import Interrupted
    from conveyor.run.record import record_path

    stopped = outcomes.stopped
    if isinstance(stopped, Interrupted):
        signals._SIGNAL[:] = [stopped.signal_name]
    names = outcomes.run.interrupted
    what = f"stopped {', '.join(names)} (recorded interrupted)" if names else "no trial was running"
    signals.stopped(err, f"{what}; {len(outcomes.trials)} of {search.trials} trials done: the same command "
                         f"continues the search; record: {project.rel(record_path(project.root, outcomes.run.run_id))}")


class _View:
    """What the stage runner tells of a trial: warnings only (a line per trial ends comes from :func:`_heard`)."""

    def started(self, stage: str, profile: str, progress: StageProgress) -> None:
        pass

    def retrying(self, stage: str, attempt: int, error: str) -> None:
        pass

    def warning(self, stage: str, line: str) -> None:
        err.print(f"{stage}: {line}", style="yellow", highlight=False, soft_wrap=True)

    def notice(self, stage: str, line: str) -> None:
        err.print(f"{stage}: {line}", highlight=False, soft_wrap=True)
