"""Checkpoints that outlive a stopped attempt: ``.conveyor/checkpoints/<stage>/<key>/``.

A long training killed at 90 % (kill -9, a time limit, Ctrl-C) should not start from zero.
Each attempt of a stage gets a folder that is neither an out nor in dvc.lock (a task's
``ctx.checkpoint_dir``, a command's ``CONVEYOR_CHECKPOINT_DIR``), named by a key over what
makes the stage stale: its command, declared params and the content of its deps and code.
The next attempt with the same key finds what the stopped one saved there; a changed key
starts clean (the other folders of the stage are dropped, and the log says so); a stage
that succeeded has its checkpoints removed. All of a project's checkpoints together hold at most
``CONVEYOR_CHECKPOINTS_MAX`` bytes (default 10GiB): when an attempt starts, the oldest saves go
first, never a running stage's nor the newest (:func:`bound`).

What was saved is the task's business; how far it got is conveyor's, so that the record,
the live view and ``conveyor status`` can say "resumed from round 300 of 500": the saver
writes ``progress.json`` beside its files with :meth:`Checkpoint.mark` (atomically, after
the files it describes). Light on imports: tasks and the training helpers import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from conveyor.workspace import STATE_DIR, alive

if TYPE_CHECKING:
    from conveyor.plan.fingerprint import Hasher
    from conveyor.spec.project import Project

FOLDER = "checkpoints"
PROGRESS = "progress.json"
ENV_DIR, ENV_RUN = "CONVEYOR_CHECKPOINT_DIR", "CONVEYOR_RUN_ID"
ENV_MAX, DEFAULT_MAX = "CONVEYOR_CHECKPOINTS_MAX", "10GiB"


@dataclass(frozen=True)
class Progress:
    """How far a saved checkpoint got: ``step`` of ``total`` ``unit``s, saved by run ``run_id``."""

    step: int
    total: int | None
    unit: str
    run_id: str
    saved: str  # ISO-8601
    state: dict[str, Any] = field(default_factory=dict)  # the saver's own: which file, what it needs to go on

    @property
    def fraction(self) -> float | None:
        return self.step / self.total if self.total else None

    def where(self) -> str:
        """``round 300 of 500``."""
        of = f" of {self.total:,}" if self.total else ""
        return f"{self.unit} {self.step:,}{of}"

    def describe(self) -> str:
        """``round 300 of 500 (checkpoint of run 20261126T…)``."""
        return f"{self.where()} (checkpoint of run {self.run_id})"


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint folder of one stage attempt (picklable: it travels to Dask workers)."""

    path: Path
    run_id: str

    def progress(self) -> Progress | None:
        """What the latest complete save says of itself; None when nothing was saved."""
        return read_progress(self.path)

    def mark(self, step: int, total: int | None = None, unit: str = "step",
             state: dict[str, Any] | None = None) -> None:
        """Say that the files saved so far hold ``step`` of ``total`` units: call after they are written.
        ``state``: what the saver needs to go on (JSON), read back from :meth:`progress`."""
        body = Progress(step, total, unit, self.run_id, datetime.now(UTC).isoformat(), dict(state or {}))
        write_atomically(self.path / PROGRESS, json.dumps(asdict(body)).encode())


def read_progress(folder: Path) -> Progress | None:
    try:
        data = json.loads((folder / PROGRESS).read_text(encoding="utf-8"))
        return Progress(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path`` through a temporary file, fsync and a rename: a kill mid-save leaves the
    previous file whole. The folder is synced too, so the rename survives a power loss."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CURRENT: ContextVar[Checkpoint | None] = ContextVar("conveyor_checkpoint", default=None)


def current() -> Checkpoint | None:
    """The checkpoint of the stage running in this thread (a task), or of this process (a command
    or an isolated task: from ``CONVEYOR_CHECKPOINT_DIR``); None outside a stage."""
    found = _CURRENT.get()
    if found is None and os.environ.get(ENV_DIR):
        return Checkpoint(Path(os.environ[ENV_DIR]), os.environ.get(ENV_RUN, ""))
    return found


@contextmanager
def using(checkpoint: Checkpoint) -> Iterator[None]:
    """Make ``checkpoint`` the one :func:`current` returns in this thread (the stage's task)."""
    token = _CURRENT.set(checkpoint)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def inputs_key(project: Project, stage: str, hasher: Hasher) -> str:
    """A short hash of what makes ``stage`` stale: command, declared params, deps and code by content."""
    from conveyor.plan.fingerprint import current_deps, stage_cmd

    body = {"cmd": stage_cmd(stage, project), "params": project.stage_params(stage),
            "deps": [(e.path, e.md5) for e in current_deps(project, stage, hasher)]}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_folder(root: Path, stage: str) -> Path:
    """Where a stage's checkpoints live (its name quoted: a dvc.yaml stage may be ``sub/dvc.yaml:train``)."""
    return root / STATE_DIR / FOLDER / quote(stage, safe="@-_.,=")


def prepare(root: Path, stage: str, key: str, run_id: str) -> tuple[Checkpoint, Progress | None, list[Progress]]:
    """The attempt's checkpoint (made), what it holds, and what was dropped: the stage's checkpoints of
    other inputs, which no attempt can resume (a param, a dep or the code changed since)."""
    folder = stage_folder(root, stage)
    dropped = [p for other in _keys(folder) if other.name != key and (p := _remove(other)) is not None]
    path = folder / key
    path.mkdir(parents=True, exist_ok=True)
    for torn in path.glob(".*.tmp"):  # of a save killed half-way (a live writer's pid: leave it)
        pid = torn.name.rsplit(".", 2)[-2]
        if not (pid.isdigit() and alive(int(pid))):
            torn.unlink(missing_ok=True)
    return Checkpoint(path, run_id), read_progress(path), dropped


def found(root: Path, stage: str, key: str) -> Progress | None:
    """The progress of a checkpoint the next attempt of ``stage`` would resume (for ``conveyor status``)."""
    return read_progress(stage_folder(root, stage) / key)


def drop(root: Path, stage: str) -> None:
    """Remove every checkpoint of ``stage`` (it succeeded: none will be resumed)."""
    shutil.rmtree(stage_folder(root, stage), ignore_errors=True)


def saved_stages(root: Path) -> dict[str, int]:
    """Every stage with checkpoints, and their size in bytes."""
    base = root / STATE_DIR / FOLDER
    if not base.is_dir():
        return {}
    sizes = {unquote(folder.name): _size(folder) for folder in sorted(base.iterdir()) if folder.is_dir()}
    return {stage: size for stage, size in sizes.items() if size}  # a failed attempt that saved nothing: none


def _keys(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    except FileNotFoundError:  # removed meanwhile: a stage that succeeded drops its own
        return []


def _remove(folder: Path) -> Progress | None:
    progress = read_progress(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return progress


def _size(folder: Path) -> int:
    found = _footprint(folder)
    return found[1] if found is not None else 0


def limit() -> int:
    """The most bytes a project's checkpoints may hold together (``CONVEYOR_CHECKPOINTS_MAX``, a size
    such as ``10GiB`` or ``500MB``); a bad value is a usage error (exit 2)."""
    from conveyor.errors import UsageError
    from conveyor.spec.base import size_in_bytes

    raw = os.environ.get(ENV_MAX, "").strip() or DEFAULT_MAX
    try:
        return size_in_bytes(raw)
    except ValueError:
        raise UsageError(f"{ENV_MAX}={raw!r}: give the most a project's checkpoints may hold together, like "
                         f"{DEFAULT_MAX} or 500MB (the oldest are dropped first)") from None


@dataclass(frozen=True)
class Dropped:
    """A checkpoint :func:`bound` removed: its stage, how far it had got, its size."""

    stage: str
    progress: Progress | None
    size: int


def bound(root: Path, most: int, keep: Collection[Path] = ()) -> list[Dropped]:
    """Drop the project's checkpoints, oldest save first, until together they hold at most ``most``
    bytes. Never one in ``keep`` (the run's running stages') nor the newest of all (the latest
    stopped attempt's: a bound lower than one save still leaves it resumable)."""
    base = root / STATE_DIR / FOLDER
    folders = [key for stage in base.iterdir() if stage.is_dir() for key in _keys(stage)] if base.is_dir() else []
    sized = sorted(((*found, f) for f in folders if (found := _footprint(f)) is not None), key=lambda t: t[0])
    total = sum(size for _, size, _ in sized)
    spared = {*keep, *([sized[-1][2]] if sized else [])}  # the newest: the last in order of saving
    dropped = []
    for _, size, folder in sized:
        if total <= most:
            break
        if folder in spared:
            continue
        dropped.append(Dropped(unquote(folder.parent.name), _remove(folder), size))
        total -= size
        with suppress(OSError):
            folder.parent.rmdir()  # the stage's last one
    return dropped


def _footprint(folder: Path) -> tuple[float, int] | None:
    """When anything in ``folder`` was last written, and the bytes it holds (one walk); None when
    it went meanwhile (another stage of the run succeeded and dropped its own, or saved anew)."""
    try:
        stats = [p.stat() for p in folder.rglob("*") if p.is_file()]
        return max((st.st_mtime for st in stats), default=folder.stat().st_mtime), sum(st.st_size for st in stats)
    except FileNotFoundError:
        return None
