"""Data missing from the workspace or the cache, as ``dvc repro --allow-missing`` and ``--pull``
treat it (dvc/repo/reproduce.py, dvc/stage/__init__.py, dvc/stage/run.py), by DVC's own calls:
skipped where it is the only change, or brought from the DVC remote with the run cache. The
record's session holds DVC's repository lock; DVC's pull takes it again (reentrant, as inside
``dvc repro``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dvc.repo import Repo
    from dvc.stage import PipelineStage, Stage

log = logging.getLogger("dvc.stage")  # DVC's lines, where `dvc repro` logs them


def changed_with_data(stage: PipelineStage, upstream: list[PipelineStage]) -> bool:
    """DVC's ``Stage.changed(allow_missing=True)``: a dep or out that is only missing (deleted, or
    an out not in the cache) is no change, unless an ``upstream`` stage's out at that path now
    hashes to something else."""
    return bool(stage.changed(allow_missing=True, upstream=upstream))


def pull_run_cache(repo: Repo) -> None:
    """First, the run cache; a remote that cannot hold one, or none, is a warning and the run goes
    on, as in DVC ("WARNING: Failed to pull run cache: ...")."""
    from dvc.config import NoRemoteError
    from dvc.stage.cache import RunCacheNotSupported

    try:
        repo.stage_cache.pull(None)
    except (RunCacheNotSupported, NoRemoteError) as exc:
        log.warning("Failed to pull run cache: %s", " ".join(str(exc).split()))


def pull_missing_deps(stage: PipelineStage) -> None:
    """``dvc repro --pull``'s first step for a stage about to run (dvc/stage/run.py,
    ``_pull_missing_deps``): each dep that is not in the workspace, pulled from the DVC remote."""
    for dep in stage.deps:
        if dep.protocol == "local" and not dep.exists:
            stage.repo.pull(dep.def_path)


def pulled_instead(stage: Stage) -> bool:
    """``dvc repro --pull`` for a stage whose only change is missing data: its outs pulled from the
    DVC remote and checked out instead of running it (``Stage.reproduce``); False when the remote
    lacks them (DVC: "Unable to pull data"), and the stage runs. A ``.dvc`` file's data too."""
    from dvc.exceptions import CheckoutError
    from dvc.stage import PipelineStage

    log.info("Pulling data for %s", stage)
    try:  # addressed by absolute path: conveyor may run from a folder below the root
        stage.repo.pull(f"{stage.path}:{stage.name}" if isinstance(stage, PipelineStage) else stage.path)
        stage.checkout()
    except CheckoutError:
        log.info("Unable to pull data for %s", stage)
        return False
    return True
