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

from conveyor.errors import plain

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
    last_line: str = ""  # the stage's latest log line, shown while it reports no progress of its own
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def start(self, total: float | None, *, unit: str = "", description: str = "") -> None:
        """(Re)start the bar: ``total`` units of work, none done yet."""
        with self._lock:
            self.total, self.completed, self.unit, self.description = total, 0.0, unit, description

    def advance(self, amount: float = 1.0) -> None:
        """Mark ``amount`` more units as done."""
        with self._lock:
            self.completed += amount

    def note(self, line: str) -> None:
        """The stage wrote ``line`` to its log."""
        self.last_line = plain(line).strip()[-160:]

    def render(self) -> str:
        """A short text such as ``"12/15 files"`` for the stage's line in the live view."""
        with self._lock:
            if self.total is None and not self.completed:
                return self.description or self.last_line
            done = _number(self.completed) + (f"/{_number(self.total)}" if self.total is not None else "")
            text = f"{done} {self.unit}".strip()
            return f"{self.description} {text}".strip()


def _number(x: float) -> str:
    """``12``, ``3.5``, ``0.12``, ``1,024``: short, and never ``0.119889``."""
    if float(x).is_integer():
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


@dataclass(frozen=True)
class StageContext:
    """Everything a task may use; the runner builds one per attempt.

    ``deps``, ``outs`` and ``metrics`` map each declared path to the absolute path to read
    or write: the declared place itself. The runner moved the previous outs aside before
    the task started and puts them back if it fails, so a task writes in place, as any
    script under ``dvc repro`` does. A task finds its paths by name (the spec's
    ``deps: {model: models/xgb.json}``), by the declared path, or, where a stage declares
    one of a kind, with no argument: ``ctx.dep()``, ``ctx.out()``, ``ctx.metric()``.
    """

    stage: str
    params: Mapping[str, Any]
    deps: Mapping[str, Path]
    outs: Mapping[str, Path]
    metrics: Mapping[str, Path]
    root: Path
    log: logging.Logger
    names: Mapping[str, str] = field(default_factory=dict)  # name -> declared path, for deps, outs, metrics
    item: Any = None  # the matrix item of this stage, if it has one
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

    def dep(self, name: str | None = None) -> Path:
        """A dep's path: by its name or declared path; with no argument, the stage's only dep."""
        return self._lookup(self.deps, name, "deps")

    def out(self, name: str | None = None) -> Path:
        """Where to write an out (or a metrics file, by name or path); no argument: the only out."""
        if name is not None and self.names.get(name, name) in self.metrics:
            return self.metrics[self.names.get(name, name)]
        return self._lookup(self.outs, name, "outs")

    def metric(self, name: str | None = None) -> Path:
        """Where to write a metrics file: by name or path; no argument: the stage's only one."""
        return self._lookup(self.metrics, name, "metrics")

    def _lookup(self, paths: Mapping[str, Path], name: str | None, kind: str) -> Path:
        if name is None:
            if len(paths) == 1:
                return next(iter(paths.values()))
            raise KeyError(f"stage '{self.stage}' declares {len(paths)} {kind}: name the one you mean "
                           f"({self._listing(paths)})")
        declared = self.names.get(name, name)
        if declared in paths:
            return paths[declared]
        raise KeyError(f"stage '{self.stage}' has no {kind} entry '{name}' (declared: {self._listing(paths)})")

    def _listing(self, paths: Mapping[str, Path]) -> str:
        named = {path: name for name, path in self.names.items()}
        return ", ".join(f"{named[p]}: {p}" if p in named else p for p in paths) or "none"
