"""Which outs a project's record vouches for: asked before a killed run's journal puts back the
previous outs, which must never win over outs someone recorded after the kill."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.dvc.compile import compiled_from, dvc_yaml
from conveyor.dvc.lockfile import pending_entries
from conveyor.spec.project import Project

if TYPE_CHECKING:
    from conveyor.plan.fingerprint import Hasher


def recorded_in_place(project: Project) -> Callable[[str, Sequence[str]], bool]:
    """Whether the outs ``paths`` of ``stage`` in the workspace are what the project's record holds
    for it now: written and recorded by someone (``dvc repro``, another run) after a killed run
    moved their previous versions into the journal, which must then not put those back.

    Read from the file (dvc.lock, or conveyor's own record), not through DVC's repository: the
    question comes from ``status`` and ``exec`` too, and ``exec`` runs under ``dvc repro``, which
    holds that lock. Hashes as DVC writes them (conveyor's hasher gives DVC's for files and
    directories)."""
    from conveyor.plan.fingerprint import Hasher, LockRecord

    hasher = Hasher()
    if project.dvc is None and not compiled_from(project):
        own = LockRecord.for_project(project)
        return lambda stage, paths: _vouched(project, hasher, stage, paths, own.get, {})
    records: dict[Path, tuple[LockRecord, dict[str, Any]]] = {}

    def check(stage: str, paths: Sequence[str]) -> bool:
        # dvc.lock: the same reader (it reads YAML as well as conveyor's JSON), beside the stage's dvc.yaml
        dvc_file = project.dvc.file_of(stage) if project.dvc is not None else dvc_yaml(project)
        name = project.dvc.name_in_file(stage) if project.dvc is not None else stage
        if dvc_file not in records:
            lock = LockRecord(dvc_file.with_suffix(".lock"))
            records[dvc_file] = lock, pending_entries(project.root, lock.path)  # recorded, not yet written
        lock, pending = records[dvc_file]
        return _vouched(project, hasher, stage, paths, lambda _: lock.get(name), pending.get(name))

    return check


def _vouched(project: Project, hasher: Hasher, stage: str, paths: Sequence[str],
             read: Callable[[str], Mapping[str, Any] | None], pending: Mapping[str, Any] | None) -> bool:
    import yaml

    try:
        recorded = pending or read(stage)
    except (OSError, ValueError, yaml.YAMLError):  # unreadable: no one vouches, the journal puts back
        return False
    return outs_match(project, stage, recorded, paths, hasher)


def outs_match(project: Project, stage: str, recorded: Mapping[str, Any] | None, paths: Sequence[str] | None = None,
               hasher: Hasher | None = None) -> bool:
    """Whether the outs ``paths`` of ``stage`` in the workspace (default: every out ``recorded``
    names) hash to what its lock entry ``recorded`` holds for them."""
    from conveyor.plan.fingerprint import Hasher

    spec = project.pipeline.stages.get(stage)
    if recorded is None or spec is None:
        return False
    # a dvc.yaml's stage: its lock entry's paths are relative to its wdir (dvc.lock records a wdir
    # relative to the dvc.yaml, which for another dvc.yaml than the root's is not the root)
    wdir = (spec.wdir if project.dvc is not None else recorded.get("wdir")) or ""
    hashes = {os.path.normpath(os.path.join(wdir, str(o.get("path")))): o.get("md5")
              for o in recorded.get("outs", []) if isinstance(o, Mapping)}
    hasher = hasher or Hasher()
    for path in paths if paths is not None else list(hashes):
        now = hasher.entry(project.root, path)
        if now is None or hashes.get(os.path.normpath(path)) != now.md5:
            return False
    return bool(paths if paths is not None else hashes)
