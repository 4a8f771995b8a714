"""What loading a dvc.yaml through DVC leaves for the rest of the command.

:class:`DvcLoaded`: DVC's open repository and built stages, handed once to the run's record,
so one command has DVC parse dvc.yaml and dvc.lock and build each stage once.
:class:`SchemaChecked`: whether DVC's schema check already passed on the very bytes of the
dvc.yaml, so an unchanged file is not checked again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dvc.repo import Repo
    from dvc.stage import PipelineStage


def stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is written (in place or replaced); None when it is absent."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class DvcLoaded:
    """DVC's repository and stages (with what dvc.lock records) as loading the project made
    them, handed once to the run's record (:class:`conveyor.dvc.record.DvcRecord`): one
    command has DVC open the repository, parse dvc.yaml and dvc.lock and build each stage
    once, not twice. A handle never taken closes its repository when it is collected.
    """

    def __init__(self, repo: Repo, stages: Mapping[str, PipelineStage], locked: frozenset[str], lock: Path,
                 lock_stamp: tuple[int, int, int] | None) -> None:
        self._repo: Repo | None = repo
        self._stages, self._locked = stages, locked
        self._lock, self._lock_stamp = lock, lock_stamp
        self._taken = threading.Lock()
        self._close = weakref.finalize(self, repo.close)

    def take(self) -> Repo | None:
        """The open repository, now the caller's to close; None when already taken."""
        with self._taken:
            repo, self._repo = self._repo, None
        if repo is not None:
            self._close.detach()
        return repo

    def current(self) -> tuple[Mapping[str, PipelineStage], frozenset[str]] | None:
        """The stages by name and those dvc.lock records; None when dvc.lock was written since."""
        return (self._stages, self._locked) if stamp(self._lock) == self._lock_stamp else None



class SchemaChecked:
    """Whether DVC's schema check already passed on these very bytes of a dvc.yaml, with this DVC.

    DVC checks a dvc.yaml against its schema each time it loads it, and keeps nothing of the
    check (its loader discards the checked copy). The check compiles a schema per stage:
    0.5-0.9 ms of each stage of a no-op run. What passed once passes again, so it runs when the
    file (or DVC) changed since it last passed: the file's hash, with DVC's version, is kept
    in ``.conveyor/dvc-schema-checked``.
    """

    def __init__(self, root: Path, dvc_file: Path) -> None:
        import hashlib

        from dvc import __version__ as dvc_version

        from conveyor.workspace import STATE_DIR

        self.root = root
        self.path = root / STATE_DIR / "dvc-schema-checked"
        try:
            self.digest: str | None = hashlib.sha256(dvc_file.read_bytes()).hexdigest()
        except OSError:
            self.digest = None
        self.key = f"{dvc_file.resolve()} sha256 {self.digest} dvc {dvc_version}\n"
        try:
            self.before = self.digest is not None and self.path.read_text(encoding="utf-8") == self.key
        except (OSError, UnicodeDecodeError):
            self.before = False

    def remember(self) -> None:
        """DVC's check passed (or had passed): the next load skips it while nothing changes."""
        if self.before or self.digest is None:
            return
        from conveyor.workspace import replace_atomically, state_dir

        try:
            state_dir(self.root)
            replace_atomically(self.path, self.key)
        except OSError:  # a read-only project: DVC checks it each time, as it always does
            pass
