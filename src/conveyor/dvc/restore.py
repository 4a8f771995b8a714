"""Restoring a stage's outs from DVC's cache, checked byte for byte.

DVC never reads a cache object to trust it: dvc_data takes a read-only object as intact
(``LocalHashFileDB.check``) and a file whose inode, mtime and size it has seen as the hash it
saw then (its state database). A cache object damaged on disk (bit rot, mtime kept) is then
checked out by DVC's run cache as the stage's recorded out, the checkout records the damaged
copy in the state database under the recorded hash, and ``dvc status`` calls it clean.

Here a restore is DVC's own, step by step, and each out it checked out is hashed again (DVC's
hashing, without its state) against the hash DVC recorded for it. On a mismatch the damaged
objects are moved aside and the restored outs removed, so that the stage runs instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.errors import DamagedCacheError

if TYPE_CHECKING:
    from dvc.output import Output
    from dvc.stage import PipelineStage

log = logging.getLogger("dvc.stage.cache")  # DVC's line, where `dvc repro` logs it

# beside the object databases in DVC's cache directory: on the same file system (a rename), and
# not a place DVC lists objects from (``files/md5/ab/cdef…``; two-character folders at the top)
DAMAGED = "damaged"


def checkout_recorded(stage: PipelineStage, *, run_cache: bool = True, pull: bool = False) -> PipelineStage:
    """Check out what DVC recorded for ``stage`` with its current deps, params and command, as
    ``dvc repro`` does instead of running it; returns the stage DVC checked out, whose outs hold
    the recorded hashes. Raises DVC's ``RunCacheNotFoundError`` when there is nothing to restore.

    DVC's ``StageCache.restore`` (dvc 3.x), which keeps that stage to itself: dvc.lock's own entry
    when the command and deps are as it records them (an out was deleted), else (unless
    ``run_cache`` is off: ``--no-run-cache``) the run cache's newest entry for these deps; with
    ``pull`` (``--pull``), the outs' objects are fetched from the DVC remote first."""
    from dvc.exceptions import CollectCacheError
    from dvc.stage.cache import RunCacheNotFoundError, _can_hash
    from dvc.stage.serialize import to_single_stage_lockfile

    if not _can_hash(stage):
        raise RunCacheNotFoundError(stage)
    runs = stage.repo.stage_cache
    entry: Any
    if not stage.changed_stage() and stage.deps_cached() and all(bool(out.hash_info) for out in stage.outs):
        entry = to_single_stage_lockfile(stage)
    else:
        if not run_cache:
            raise RunCacheNotFoundError(stage)
        stage.save_deps()
        entry = runs._load(stage)  # DVC's lookup of its newest entry for these deps
        if not entry:
            raise RunCacheNotFoundError(stage)
    cached: PipelineStage = runs._create_stage(entry, wdir=stage.wdir)
    if pull:
        try:
            for objects in cached.get_used_objs().values():
                stage.repo.cloud.pull(objects)
        except CollectCacheError as exc:
            raise RunCacheNotFoundError(stage) from exc
    if not cached.outs_cached():
        raise RunCacheNotFoundError(stage)
    log.info("Stage '%s' is cached - skipping run, checking out outputs", stage.addressing)
    cached.checkout()
    return cached


@dataclass(frozen=True)
class Damage:
    """What a restore brought back wrong: outs whose bytes do not hash to their recorded hash,
    and the cache objects behind them whose own bytes do not hash to their name (absolute paths)."""

    outs: tuple[str, ...]
    objects: tuple[str, ...]


def damage(cached: PipelineStage) -> Damage | None:
    """None when every out ``cached`` checked out hashes to what DVC recorded for it."""
    outs: list[str] = []
    objects: list[str] = []
    for out in cached.outs:
        matches, bad = _check_dir(out) if out.hash_info.isdir else _check_file(out)
        if not matches:
            outs.append(out.fs_path)
        objects += bad
    return Damage(tuple(outs), tuple(objects)) if outs or objects else None


def _check_file(out: Output) -> tuple[bool, list[str]]:
    """Whether a file out hashes to its recorded hash; else the cache object, if it is damaged."""
    if _hashes_to(out.fs_path, out.hash_info.name, out.hash_info.value):
        return True, []
    obj = out.cache.oid_to_path(out.hash_info.value)
    return False, [] if _hashes_to(obj, out.hash_info.name, out.hash_info.value) else [obj]


def _check_dir(out: Output) -> tuple[bool, list[str]]:
    """Whether each file of a directory out hashes to the hash its listing (the ``.dir`` object)
    records for it, and the listing to its own name; the damaged objects among them."""
    listing = out.cache.oid_to_path(out.hash_info.value)
    if not _hashes_to(listing, "md5", out.hash_info.value.removesuffix(".dir")):
        return False, [listing]  # its entries cannot be trusted: nothing below it is checked
    tree = out.get_obj()
    matches, bad = tree is not None, []
    for key, _meta, info in tree or ():
        if info is None or _hashes_to(os.path.join(out.fs_path, *key), info.name, info.value):
            continue
        matches = False
        obj = out.cache.oid_to_path(info.value)
        if not _hashes_to(obj, info.name, info.value):
            bad.append(obj)
    return matches, bad


def _hashes_to(path: str, name: str | None, value: str | None) -> bool:
    """Whether the bytes at ``path`` hash to ``value``: DVC's hashing (``md5-dos2unix`` for outs
    DVC 2 recorded), without DVC's state, which would answer from the inode and mtime."""
    from dvc.fs import LocalFileSystem
    from dvc_data.hashfile.hash import hash_file

    try:
        _meta, actual = hash_file(path, LocalFileSystem(), name or "md5")
    except OSError:  # gone, or a folder where a file was recorded
        return False
    return actual.value == value


def set_aside(stage: str, cached: PipelineStage, found: Damage, rel: Any) -> DamagedCacheError:
    """Move the damaged objects aside and remove the restored outs, so that the stage runs as if
    there were nothing to restore; the error that tells the user (``rel``: a path as they see it).

    Moved, not deleted (DVC has no repair of its cache): DVC adds an out to its cache only when
    no object of that name is there, so a damaged object left in place would be restored again
    by the next restore and kept by the commit after the stage runs; moved aside, the next
    commit stores good bytes under its name, and the damaged bytes stay for the user to look at."""
    cache_dir = cached.repo.cache.legacy.path  # DVC's cache directory (the legacy database is its root)
    moved, stuck = [], []
    for obj in found.objects:
        target = os.path.join(cache_dir, DAMAGED, os.path.relpath(obj, cache_dir))
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(obj, target)
        except OSError:  # a shared cache this user cannot write: said in the message
            stuck.append(rel(obj))
        else:
            moved.append(rel(obj))
    for out in cached.outs:
        out.remove()
    return DamagedCacheError(stage, outs=[rel(path) for path in found.outs], objects=moved, stuck=stuck,
                             aside=rel(os.path.join(cache_dir, DAMAGED)))
