"""Atomic outs, wherever a stage writes them: the outs journal (SPEC.md section 2.2).

Before a stage runs, the previous version of each out it declares is moved into a journal
entry under ``.conveyor/journal/`` (a rename: no data is copied), so the stage writes
into empty places, as under ``dvc repro``. Outs marked ``persist`` stay in place and a copy
goes into the entry instead. Then:

- the stage succeeds: the entry is dropped (renamed out of recovery's sight, then deleted),
  the new outs stay;
- it fails, times out or is interrupted: whatever it wrote is removed and the previous
  outs are moved back;
- the process dies (kill -9): the entry stays behind, and the next conveyor command in
  the project (``run``, ``status``, ``exec``) moves the previous outs back.

An entry's manifest is written before anything moves, and says for each out whether it
existed; a rename either happened or not, so recovery knows, out by out, what the project
held before. While its stage runs, the entry's lock file is held (``flock``); the kernel
releases it when the process dies, which is how recovery tells an abandoned entry from one
whose stage is still running in another process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from conveyor.workspace import STATE_DIR, replace_atomically, state_dir

MANIFEST = "manifest.json"
LOCK = "lock"
RECOVERED = "put back the previous outs of '{stage}': its last run was killed"
KEPT_RECORDED = ("kept the outs of '{stage}' in place: its last run was killed, and the outs there now are the ones "
                 "its record holds (written and recorded after the kill, by dvc repro or that run); "
                 "its older outs were dropped")


@dataclass(frozen=True)
class Kept:
    """One declared out of a stage that is running: where it is, and whether it existed."""

    path: str  # project-relative, as declared
    existed: bool
    persist: bool
    slot: str  # the name of its previous version inside the entry

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "existed": self.existed, "persist": self.persist, "slot": self.slot}


def remove(path: Path) -> None:
    """Remove a file, a link or a directory tree at ``path``; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _move(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``; across file systems, copy whole then rename, then delete."""
    try:
        os.replace(source, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    _copy(source, target)
    remove(source)


def _copy(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a partial sibling, so ``target`` is whole or absent."""
    partial = target.with_name(target.name + ".partial")
    remove(partial)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, partial, symlinks=True)
    else:
        shutil.copy2(source, partial, follow_symlinks=False)
    os.replace(partial, target)


# (stage, its outs): whether the outs in the workspace are the ones the project's record holds now
Recorded = Callable[[str, Sequence[str]], bool]


@dataclass(frozen=True)
class Recovered:
    """What recovery did with the entries of dead processes: stages whose previous outs went
    back, and stages whose outs stayed because the record holds them (written after the kill)."""

    restored: list[str]
    kept: list[str]


class Entry:
    """The journal entry of one stage attempt, held (locked) by this process."""

    def __init__(self, root: Path, folder: Path, stage: str, outs: Sequence[Kept], lock: IO[str]) -> None:
        self.root, self.folder, self.stage, self.outs, self._lock = root, folder, stage, tuple(outs), lock
        self._settle = threading.Lock()
        self._settled = False  # restored or dropped: once only (an abandoned stage's thread may still end)

    def restore(self) -> None:
        """Put the previous outs back, removing what the stage wrote in their place."""
        with self._settle:
            if not self._settled:
                self._settled = True
                restore_outs(self.root, self.folder, self.outs)

    def drop(self) -> None:
        """The stage succeeded: forget the previous outs."""
        with self._settle:
            if not self._settled:
                self._settled = True
                _discard(self.folder)

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


def restore_outs(root: Path, folder: Path, outs: Sequence[Kept]) -> None:
    """Undo a stage's writes, out by out, from what the manifest and the entry hold."""
    for out in reversed(outs):
        target, kept = root / out.path, folder / out.slot
        if kept.exists() or kept.is_symlink():
            remove(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            _move(kept, target)
        elif not out.existed:
            remove(target)  # whatever the stage began to write where nothing was
        # else: it existed and was never moved away, or (persist) never copied: still in place
    _discard(folder)


def _discard(folder: Path) -> None:
    """Delete an entry that has served: first renamed to a hidden name, so that a kill -9 while
    its previous outs are deleted (a large out takes a while) leaves nothing that recovery would
    move back half deleted, then emptied with its lock last (the lock, still held, tells
    recovery whether the process doing this is alive; see :meth:`Journal._recover_entry`)."""
    hidden = folder.with_name(f".{folder.name}.done")
    os.replace(folder, hidden)
    for child in list(hidden.iterdir()):
        if child.name != LOCK:
            remove(child)
    remove(hidden)


class Journal:
    """The outs journal of one project (``.conveyor/journal/``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / STATE_DIR / "journal"

    @contextmanager
    def protect(self, stage: str, outs: Sequence[str], persist: Collection[str] = ()) -> Iterator[Entry]:
        """Keep the previous ``outs`` aside while the body runs; put them back if it raises.

        The body returning means success: the entry is dropped. Any exception (a failed
        task, a timeout, KeyboardInterrupt) restores the previous outs, then propagates.
        """
        entry = self._open(stage, outs, persist)
        try:
            self._keep(entry)
            yield entry
        except BaseException:
            entry.restore()
            raise
        else:
            entry.drop()
        finally:
            entry.release()

    def _open(self, stage: str, outs: Sequence[str], persist: Collection[str]) -> Entry:
        """A locked entry with its manifest, made under a hidden name and renamed into the journal
        whole, so recovery never sees an entry without both."""
        name = f"{_safe(stage)}-{uuid.uuid4().hex[:8]}"
        state_dir(self.root)
        draft = self.folder / f".{name}"
        draft.mkdir(parents=True)
        lock = (draft / LOCK).open("w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = [Kept(path, (self.root / path).exists() or (self.root / path).is_symlink(), path in persist, str(i))
                for i, path in enumerate(outs)]
        manifest = {"stage": stage, "pid": os.getpid(), "outs": [k.to_dict() for k in kept]}
        replace_atomically(draft / MANIFEST, json.dumps(manifest, indent=1), durable=True)
        folder = self.folder / name
        os.replace(draft, folder)
        return Entry(self.root, folder, stage, kept, lock)

    def _keep(self, entry: Entry) -> None:
        """Move each previous out into the entry (copy it, for ``persist`` outs)."""
        for out in entry.outs:
            target = self.root / out.path
            if not out.existed:
                target.parent.mkdir(parents=True, exist_ok=True)
            elif out.persist:
                _copy(target, entry.folder / out.slot)
            else:
                _move(target, entry.folder / out.slot)

    def recover(self, recorded: Recorded | None = None) -> Recovered:
        """Put back the previous outs of every stage whose process died, unless ``recorded`` says
        the outs in their place are what the project's record holds now (someone wrote and
        recorded them after the kill: ``dvc repro``, or the killed run itself just before it
        died): those stay, and the previous versions are dropped.

        Entries whose lock is held belong to a stage that is running now (in this or
        another process) and are left alone.
        """
        done = Recovered([], [])
        if not self.folder.is_dir():
            return done
        for folder in sorted(self.folder.iterdir()):
            self._recover_entry(folder, recorded, done)
        return done

    def running(self) -> dict[str, list[str]]:
        """The outs of each stage that is running now (its entry's lock is held), by stage: they
        are in the journal, not missing. Only reads, so a read-only command can ask."""
        held: dict[str, list[str]] = {}
        for folder in sorted(self.folder.iterdir()) if self.folder.is_dir() else []:
            try:
                with (folder / LOCK).open("r") as lock:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    continue  # its process is gone, or it is being dropped: not running
            except BlockingIOError:
                pass
            except OSError:
                continue
            try:
                data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
                held.setdefault(str(data["stage"]), []).extend(str(o["path"]) for o in data["outs"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return held

    def _recover_entry(self, folder: Path, recorded: Recorded | None, done: Recovered) -> None:
        """Recover one entry if its process died; nothing when it is still held (or was a draft)."""
        try:
            lock = (folder / LOCK).open("r")
        except FileNotFoundError:  # dropped meanwhile (its stage just ended), or a draft being made
            _remove_stale_draft(folder)
            return None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # its stage is running
            if folder.name.startswith("."):
                remove(folder)  # a draft whose process died before any out moved, or an entry being discarded
                return None
            data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            outs = [Kept(o["path"], bool(o["existed"]), bool(o["persist"]), str(o["slot"])) for o in data["outs"]]
            stage = str(data["stage"])
            if recorded is not None and recorded(stage, [o.path for o in outs]):
                _discard(folder)
                done.kept.append(stage)
            else:
                restore_outs(self.root, folder, outs)
                done.restored.append(stage)


def _remove_stale_draft(folder: Path, age_s: float = 60.0) -> None:
    """A draft without a lock file whose process died between ``mkdir`` and ``open`` (or a
    discarded entry, between the removal of its lock and of its folder)."""
    try:
        if folder.name.startswith(".") and time.time() - folder.stat().st_mtime > age_s:
            remove(folder)
    except FileNotFoundError:
        pass


def _safe(stage: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in stage)
