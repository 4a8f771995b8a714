"""What a run reads from outside its dvc.yaml, settled as ``dvc repro`` settles it before the
first stage: ``dvc add``ed data, and deps that no stage writes.

A ``.dvc`` file is a stage upstream of those that read its data: when the data changed,
``dvc repro`` verifies it, hashes it, puts it into the cache and writes the new hash into the
``.dvc`` file, then runs the stages that read it (dvc/repo/reproduce.py, ``_reproduce_stage``
for a data source). Left out, the stages rerun on the new data while the ``.dvc`` file keeps the
old hash: ``dvc status`` reports it modified and ``dvc push`` would not send the data. Here it is
DVC's own stage doing it (``Stage.reproduce``: verify, save, commit), and the ``.dvc`` file is
written through a temporary file renamed over it, as conveyor writes dvc.lock.

A dep that no stage writes and that is not there fails the run before anything starts, in one
line, where ``dvc repro`` fails on it: ``failed to reproduce 'train': No such file or directory``.
So does a ``.dvc`` file DVC cannot reproduce (a ``dvc import`` whose repository cannot be reached
when its data changed: DVC verifies it against that repository), in DVC's words.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.dvc.missing import pulled_instead
from conveyor.errors import ConveyorError, UsageError, plain, redact
from conveyor.workspace import replace_atomically, state_dir

if TYPE_CHECKING:
    from dvc.repo import Repo
    from dvc.stage import Stage

    from conveyor.spec.project import Project


class MissingInputError(UsageError):
    """A stage's dep (or a ``.dvc`` file's data) is not there and nothing makes it: nothing runs."""


class SourceError(ConveyorError):
    """DVC could not reproduce a ``.dvc`` file the run reads: nothing runs."""


def check_unmade(project: Project, stages: Iterable[str]) -> None:
    """Raise :class:`MissingInputError` for the first of ``stages`` (not frozen: DVC does not look
    at a frozen stage's deps) with a dep that no stage writes and that is missing."""
    source = project.dvc
    if source is None:
        return
    for stage in stages:
        if stage in source.frozen:
            continue
        missing = [dep for dep in source.unmade.get(stage, ()) if not os.path.lexists(project.root / dep)]
        if missing:
            raise MissingInputError(f"failed to reproduce '{stage}': No such file or directory: "
                                    f"{', '.join(repr(m) for m in missing)} (a dep that no stage of the "
                                    "repository writes: make it, or remove it from the stage's deps)")


def sources_of(project: Project, stages: Iterable[str]) -> list[str]:
    """The ``.dvc`` files upstream of ``stages`` (frozen stages aside: DVC cuts their upstream)."""
    source = project.dvc
    if source is None:
        return []
    return list(dict.fromkeys(path for stage in stages if stage not in source.frozen
                              for path in source.sources.get(stage, ())))


def commit_sources(project: Project, repo: Repo, paths: Iterable[str], *, force: bool = False,
                   no_commit: bool = False, allow_missing: bool = False, pull: bool = False) -> list[str]:
    """Each ``.dvc`` file of ``paths`` whose data changed (all of them with ``force``, as
    ``dvc repro -f``), reproduced as ``dvc repro`` does; returns those written. ``no_commit``,
    ``allow_missing`` and ``pull``: ``dvc repro``'s flags (hashed but not put into the cache;
    data missing from the workspace or the cache is no change, or is pulled from the remote).

    Raises :class:`MissingInputError` when a file's data is gone (DVC: missing data 'source')."""
    from dvc.dvcfile import load_file
    from dvc.exceptions import DvcException
    from dvc.stage.exceptions import MissingDataSource
    from dvc.stage.utils import check_missing_outputs

    written = []
    for path in paths:
        stage = load_file(repo, str(project.root / path)).stage
        if not (force or stage.changed(allow_missing)):  # DVC's "'foo.dvc' didn't change, skipping"
            continue
        if pull and not force and not stage.changed(True) and pulled_instead(stage):
            continue
        try:
            check_missing_outputs(stage)  # before DVC says "Verifying data sources": the refusal is one line
        except MissingDataSource as exc:
            raise MissingInputError(f"failed to reproduce '{path}': {exc}: put the data back, or "
                                    f"`dvc checkout {path}` to restore it from the cache") from None
        try:
            stage.reproduce(force=True, no_commit=no_commit)  # changed, or forced: DVC verifies, saves, commits
        except DvcException as exc:  # as `dvc repro` says it: the error and its causes, on one line
            causes = ": ".join(str(e) for e in _chain(exc))
            raise SourceError(redact(plain(f"failed to reproduce '{path}': {causes}"))) from None
        if _dump(project.root, stage):
            written.append(path)
    return written


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, as DVC's logger lists them."""
    while exc is not None:
        yield exc
        exc = exc.__cause__


def _dump(root: Path, stage: Stage) -> bool:
    """The stage's ``.dvc`` file as DVC's ``SingleStageFile.dump`` writes it (its serializer, its
    round-trip YAML that keeps the user's comments), through a temporary file renamed over it:
    DVC rewrites it in place, and a kill -9 then leaves it empty. False when nothing changed."""
    from dvc.stage.serialize import to_single_stage_file
    from dvc.utils.serialize import dumps_yaml

    path = Path(stage.path)
    text = dumps_yaml(to_single_stage_file(stage))
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    replace_atomically(path, text, scratch=state_dir(root))
    stage.repo.scm_context.track_file(os.path.relpath(path))
    return True
