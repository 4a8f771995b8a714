"""DVC's "nothing changed" for each stage of a dvc.yaml, kept with what it was decided on, so
that asking again about a pipeline nobody touched does not have DVC build and hash 5,000 stages.

DVC decides that a stage changed by comparing the hashes of its deps and outs with dvc.lock,
and trusts a path's hash while the path keeps its inode, mtime and size (its state database);
it also finds each out's object in its cache. When DVC has found a stage up to date, conveyor
keeps that same triple for every file of the stage's deps and outs (every file inside a folder,
and each folder's mtime: a file added or removed), and for its outs' cache objects. The
stage is up to date again, without asking DVC, while the files the project was loaded from
(dvc.yaml, dvc.lock, params and vars files: :mod:`conveyor.spec.snapshot`) and the params files
its stages declare have the same bytes and every kept triple is the same. Anything else, a
stage DVC found changed, a path outside the repository, ``always_changed``: DVC is asked.

A triple is kept only when it was the same before and after DVC's check and its mtime is
older than the check (a file written in the instant of the check proves nothing); a session in
which any of those files changed (a stage ran and was recorded, the user edited dvc.yaml)
keeps nothing. Only under DVC's repository lock: a question asked during a run asks DVC.
Kept in ``.conveyor/dvc-status-stamps.json``: inodes and mtimes do not travel with a checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.spec.snapshot import COARSE_S, FINE_S, digest
from conveyor.workspace import STATE_DIR, replace_atomically, state_dir

if TYPE_CHECKING:
    from dvc.stage import PipelineStage

    from conveyor.spec.project import Project

FILE = "dvc-status-stamps.json"
FORMAT = 1
Triple = tuple[int, int, int]  # size, mtime_ns, inode


def triples(paths: Iterable[str]) -> dict[str, list[int]] | None:
    """Each path's [size, mtime_ns, inode], a folder's for each file in it; None when one is
    missing (a missing path is a change DVC names)."""
    found: dict[str, list[int]] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            found[path] = [st.st_size, st.st_mtime_ns, st.st_ino]
            continue
        for folder, _dirs, files in os.walk(path):
            try:
                for name in files:
                    f = os.path.join(folder, name)
                    s = os.stat(f)
                    found[f] = [s.st_size, s.st_mtime_ns, s.st_ino]
            except OSError:
                return None
    return found


class Stamps:
    """The kept answers of one record session (:class:`conveyor.dvc.record.DvcRecord`)."""

    def __init__(self, project: Project) -> None:
        self.root = project.root
        self.path = project.root / STATE_DIR / FILE
        source = project.dvc
        inputs = source.inputs if source is not None else None
        params = {str(project.root / file) for declared in (source.params.values() if source else ())
                  for file, _ in declared}
        self.files = sorted({*inputs, *params}) if inputs is not None else []
        self.usable = inputs is not None
        self.digests: dict[str, str | None] = {}
        self.kept: dict[str, Any] = {}
        self.fresh: dict[str, Any] = {}
        self.changed: set[str] = set()

    def open(self) -> bool:
        """Read what was kept; True when it holds for the files as they are now."""
        if not self.usable:
            return False
        if self.digests:  # read once per session
            return bool(self.kept)
        self.digests = {f: digest(f) for f in self.files}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("inputs") != self.digests:
            return False
        stages = data.get("stages")
        self.kept = stages if isinstance(stages, dict) else {}
        return bool(self.kept)

    def up_to_date(self, stage: str) -> bool:
        """True when DVC found ``stage`` up to date and nothing it was decided on changed since."""
        entry = self.kept.get(stage)
        if not isinstance(entry, dict) or not isinstance(entry.get("paths"), list) or stage in self.changed:
            return False
        if triples(entry["paths"]) != entry.get("triples"):
            self.changed.add(stage)  # DVC is asked, and answers for it
            return False
        self.fresh[stage] = entry
        return True

    def before(self, st: PipelineStage) -> tuple[float, dict[str, list[int]] | None] | None:
        """The paths' triples before DVC checks ``stage``; None where DVC must always be asked."""
        paths = _paths(st)
        return (time.time(), triples(paths)) if paths is not None else None

    def after(self, stage: str, st: PipelineStage, before: tuple[float, dict[str, list[int]] | None] | None,
              up_to_date: bool) -> None:
        """DVC's answer on ``stage``: kept when the paths did not change around the check."""
        if not up_to_date:
            self.changed.add(stage)
            self.fresh.pop(stage, None)
            return
        started, found = before if before is not None else (0.0, None)
        if found is None:
            return
        paths = _paths(st)
        if paths is None or triples(paths) != found:
            return
        ticks = [t[1] for t in found.values()]
        window = COARSE_S if any(t % 1_000_000_000 == 0 for t in ticks) else FINE_S
        if any(t >= (started - window) * 1e9 for t in ticks):
            return  # written in the instant of the check: its triple proves nothing
        self.fresh[stage] = {"paths": paths, "triples": found}

    def ran(self, stage: str) -> None:
        self.changed.add(stage)
        self.fresh.pop(stage, None)

    def close(self) -> None:
        """Keep this session's answers when nothing they were decided on changed during it."""
        if not self.usable or not self.digests:
            return  # nothing read or decided here (a question during a run, or nothing kept)
        if {f: digest(f) for f in self.files} != self.digests:
            self._drop()  # what the answers were decided on changed during the command
            return
        stages = {**{s: e for s, e in self.kept.items() if s not in self.changed}, **self.fresh}
        if stages == self.kept:
            return  # nothing new to keep (a command that only asked): the file stays as it is
        data = {"format": FORMAT, "inputs": self.digests, "stages": stages}
        try:
            state_dir(self.root)
            replace_atomically(self.path, json.dumps(data, separators=(",", ":")))
        except OSError:  # a read-only project: DVC is asked each time, as it always was
            pass

    def _drop(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


def _paths(st: PipelineStage) -> list[str] | None:
    """What DVC's status of ``st`` looks at on disk: its deps and outs (params files are inputs),
    and its outs' objects in DVC's cache; None where that is not all of it."""
    from dvc.dependency.param import ParamsDependency

    if st.always_changed or st.frozen:
        return None
    paths: list[str] = []
    for item in [*st.deps, *st.outs]:
        if isinstance(item, ParamsDependency):
            continue
        if item.protocol != "local" or not item.is_in_repo:
            return None
        paths.append(os.fspath(item.fs_path))
    for out in st.outs:
        if out.use_cache and out.hash_info and out.hash_info.value:
            paths += _cache_objects(out.cache, out.hash_info)
    return paths


def _cache_objects(cache: Any, hash_info: Any) -> list[str]:
    """The out's objects in DVC's cache: its file's, or a folder's listing and each file's in it."""
    listing = cache.oid_to_path(hash_info.value)
    if not hash_info.isdir:
        return [listing]
    try:
        entries = json.loads(Path(listing).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [listing]  # missing or damaged: DVC says so, and nothing is kept once it does
    return [listing, *(cache.oid_to_path(e["md5"]) for e in entries if isinstance(e, dict) and "md5" in e)]

