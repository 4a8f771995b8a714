"""Atomic outs: a stage writes temporary siblings; they replace the real paths on success.

A failed or killed stage leaves the previous outs as they were. Leftovers of a killed
run (``.conveyor-tmp-*-<name>``) are removed the next time the stage runs. The temporary
name ends with the declared one, so libraries that pick a format from the extension
(``savefig``, ``save_model``) write the right format.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from conveyor.errors import MissingOutputError

TMP_MARK = ".conveyor-tmp-"


def _sibling(path: Path, tag: str) -> Path:
    return path.with_name(f"{TMP_MARK}{tag}-{path.name}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def clean_leftovers(root: Path, declared: Iterator[str] | list[str]) -> None:
    """Remove temporary siblings left by a killed earlier attempt of these outs."""
    for rel in declared:
        target = root / rel
        if target.parent.is_dir():
            for stray in target.parent.glob(f"{TMP_MARK}*-{target.name}"):
                _remove(stray)


@contextmanager
def staged_outs(root: Path, stage: str, declared: list[str]) -> Iterator[dict[str, Path]]:
    """Yield a temporary path per declared out; move them all into place if the body succeeds.

    Every declared out must have been written, else :class:`MissingOutputError` and
    nothing is replaced. On any exception the temporaries are removed.
    """
    clean_leftovers(root, declared)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = {rel: _sibling(root / rel, tag) for rel in declared}
    for tmp in staging.values():
        tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
        missing = [rel for rel, tmp in staging.items() if not tmp.exists()]
        if missing:
            raise MissingOutputError(stage, f"did not write {', '.join(missing)}")
        _replace_all(root, staging)
    finally:
        for tmp in staging.values():
            _remove(tmp)


def _replace_all(root: Path, staging: Mapping[str, Path]) -> None:
    """Swap each staged out into place; each swap is a rename, old outs go last."""
    retired: list[Path] = []
    for rel, tmp in staging.items():
        target = root / rel
        if target.exists() or target.is_symlink():
            old = _sibling(target, f"old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
            retired.append(old)
        os.replace(tmp, target)
    for old in retired:
        _remove(old)


@contextmanager
def run_lock(root: Path) -> Iterator[None]:
    """Hold the project's run lock; a second concurrent run fails at once with a clear message."""
    import fcntl

    from conveyor.errors import RunLockedError

    path = root / ".conveyor" / "run.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            raise RunLockedError(f"another conveyor run holds {path} (pid {holder}); wait for it "
                                 "to finish, then run again") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)
