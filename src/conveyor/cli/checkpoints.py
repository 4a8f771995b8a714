"""``conveyor clean --checkpoints`` and what ``conveyor status`` says of a stage's checkpoint.

Checkpoints (:mod:`conveyor.run.checkpoints`) are conveyor's state, not the user's data: a
stage's go when it succeeds or its inputs change, and this command removes them at will (a
training that should start over, a disk that fills up).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

import typer

from conveyor.cli.common import SpecOption, StagesArg, app, out, project_of
from conveyor.errors import UsageError

if TYPE_CHECKING:
    from conveyor.run.checkpoints import Progress
    from conveyor.spec.project import Project


@app.command()
def clean(
    stages: StagesArg = None,
    config: SpecOption = None,
    checkpoints: Annotated[bool, typer.Option(
        "--checkpoints", help="Remove the checkpoints stopped runs left (.conveyor/checkpoints/): the next run "
                              "of those stages starts from scratch.")] = False,
) -> None:
    """Remove conveyor's state that a run would otherwise reuse: --checkpoints [STAGE...] (default: all)."""
    from conveyor.run.checkpoints import drop, saved_stages
    from conveyor.workspace import run_lock

    if not checkpoints:
        raise UsageError("say what to clean: `conveyor clean --checkpoints [STAGE...]`")
    project = project_of(config)
    with run_lock(project.root):  # not under a running stage's feet
        saved = saved_stages(project.root)
        chosen = _chosen(saved, stages or [])
        for stage in chosen:
            drop(project.root, stage)
    if not chosen:
        out.print("no checkpoints to remove", highlight=False)
        return
    total = sum(saved[stage] for stage in chosen)
    out.print(f"removed the checkpoints of {', '.join(chosen)} ({_size(total)})", highlight=False, soft_wrap=True)


def _chosen(saved: Mapping[str, int], stages: list[str]) -> list[str]:
    """The stages named (each must have checkpoints), or every stage that has some."""
    if not stages:
        return list(saved)
    for stage in stages:
        if stage not in saved:
            close = difflib.get_close_matches(stage, list(saved), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (stages with some: {', '.join(saved) or 'none'})"
            raise UsageError(f"no checkpoints of stage '{stage}'{hint}")
    return stages


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def status_notes(project: Project, reasons: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """For ``conveyor status``: what changed in each stage's environment (:class:`History`), and of a
    stale stage, the checkpoint its next run would resume."""
    from conveyor.run.environment import History

    history = History(project)
    notes = {stage: history.notes(stage) for stage in reasons}
    for stage, why in reasons.items():
        found = _resumable(project, stage) if why else None
        if found is not None:
            notes[stage].append(_resumes(found))
    return notes


def _resumable(project: Project, stage: str) -> Progress | None:
    """The checkpoint the next run of ``stage`` would resume: one saved with its inputs as they are now."""
    from conveyor.plan.fingerprint import Hasher
    from conveyor.run.checkpoints import found, inputs_key, stage_folder

    if not stage_folder(project.root, stage).is_dir():  # the common case: nothing to hash
        return None
    return found(project.root, stage, inputs_key(project, stage, Hasher()))


def _resumes(progress: Progress) -> str:
    """``a checkpoint at 60 % (round 300 of 500, run …) will be resumed``."""
    share = f" at {progress.fraction:.0%}" if progress.fraction is not None else ""
    return f"a checkpoint{share} ({progress.where()}, run {progress.run_id}) will be resumed"
