"""What a task receives: the ``StageContext`` of SPEC.md section 3.

Tasks are plain functions ``fn(ctx: StageContext) -> None``. This module is imported by
tasks, so it stays free of Prefect and of heavy imports: the Dask client and executor are
typed only for the checker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client


@dataclass
class StageProgress:
    """Progress of the work inside one stage (files fetched, epochs, boosting rounds).

    Thread-safe: a task may advance it from its own thread pool. The live view of
    ``conveyor run`` reads it; nothing here prints.
    """

    total: float | None = None
    completed: float = 0.0
    unit: str = ""
    description: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def start(self, total: float | None, *, unit: str = "", description: str = "") -> None:
        """(Re)start the bar: ``total`` units of work, none done yet."""
        with self._lock:
            self.total, self.completed, self.unit, self.description = total, 0.0, unit, description

    def advance(self, amount: float = 1.0) -> None:
        """Mark ``amount`` more units as done."""
        with self._lock:
            self.completed += amount

    def render(self) -> str:
        """A short text such as ``"12/15 files"`` for the stage's line in the live view."""
        with self._lock:
            if self.total is None and not self.completed:
                return self.description
            done = f"{self.completed:g}" + (f"/{self.total:g}" if self.total is not None else "")
            text = f"{done} {self.unit}".strip()
            return f"{self.description} {text}".strip()


@dataclass(frozen=True)
class StageContext:
    """Everything a task may use; the runner builds one per attempt.

    ``outs`` and ``metrics`` point at temporary siblings of the declared paths: the
    runner renames them into place only after the task returned, so a failed or killed
    stage leaves the previous outputs intact. Use :meth:`out` and :meth:`dep` to go from
    a declared (project-relative) path to the path to use.
    """

    stage: str
    params: Mapping[str, Any]
    deps: Mapping[str, Path]
    outs: Mapping[str, Path]
    metrics: Mapping[str, Path]
    root: Path
    log: logging.Logger
    client: Client | None = None
    executor: Executor | None = None
    n_workers: int = 1
    devices: tuple[int, ...] = ()
    progress: StageProgress = field(default_factory=StageProgress)
    started: float = field(default_factory=time.monotonic)

    def section_key(self, name: str) -> str:
        """The declared params key for ``name``: ``name`` itself, or the one declared key
        ending in ``.name`` (``scale.preprocess``), so another spec can give a task its own section."""
        if name in self.params:
            return name
        matches = [key for key in self.params if key.endswith(f".{name}")]
        if len(matches) == 1:
            return matches[0]
        raise KeyError(f"stage '{self.stage}' must declare the params key '{name}' or one key ending in "
                       f"'.{name}' (declared: {', '.join(self.params) or 'none'})")

    def section(self, name: str) -> Any:
        """The value of :meth:`section_key` (``ctx.section("train.xgb")``)."""
        return self.params[self.section_key(name)]

    def dep(self, declared: str) -> Path:
        """The absolute path of a declared dep (``"data/processed"``)."""
        return self._lookup(self.deps, declared, "deps")

    def out(self, declared: str) -> Path:
        """Where to write a declared out or metric (a temporary sibling of it)."""
        if declared in self.metrics:
            return self.metrics[declared]
        return self._lookup(self.outs, declared, "outs")

    def _lookup(self, paths: Mapping[str, Path], declared: str, kind: str) -> Path:
        try:
            return paths[declared]
        except KeyError:
            known = ", ".join(paths) or "none"
            raise KeyError(
                f"stage '{self.stage}' has no {kind} entry '{declared}' (declared: {known})"
            ) from None
