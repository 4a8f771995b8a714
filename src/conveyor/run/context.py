"""What a task receives: the ``StageContext`` of SPEC.md section 3.

Tasks are plain functions ``fn(ctx: StageContext) -> None``. This module is imported by
tasks, so it stays free of Prefect and of heavy imports: the Dask client and executor are
typed only for the checker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from contextlib import contextmanager
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
class MatrixItem:
    """One item of a matrix stage that this stage ``needs``: its values, and where its outs
    and metrics are, so a stage that picks the best of a sweep finds every model and score.

    ``stage`` is the item's name as DVC and ``conveyor run`` give it (``train@0.1-6``);
    ``values`` its matrix values (``{"eta": 0.1, "max_depth": 6}``, what the item's own
    ``ctx.item`` was); ``outs`` and ``metrics`` map each declared path to its absolute path.
    """

    stage: str
    values: Mapping[str, Any]
    outs: Mapping[str, Path]
    metrics: Mapping[str, Path]
    names: Mapping[str, str] = field(default_factory=dict)  # name -> declared path

    @property
    def key(self) -> str:
        """The item's name after the ``@`` (``0.1-6``): DVC's ``${key}``."""
        return self.stage.partition("@")[2]

    def out(self, name: str | None = None) -> Path:
        """An out of the item: by name or declared path; no argument: its only out."""
        return _pick(self.stage, self.outs, self.names, name, "outs")

    def metric(self, name: str | None = None) -> Path:
        """A metrics file of the item: by name or declared path; no argument: its only one."""
        return _pick(self.stage, self.metrics, self.names, name, "metrics")

    def scores(self) -> dict[str, float]:
        """The numbers in the item's metrics files by dotted key (``test.rmse``), as ``compare``
        shows them (keyed ``file:key`` when it has several files); empty when none is written."""
        from conveyor.run.metrics import read_metrics

        several = len(self.metrics) > 1
        return {f"{rel}:{key}" if several else key: value
                for rel, path in self.metrics.items() for key, value in read_metrics(path).items()}


@dataclass(frozen=True)
class StageContext:
    """Everything a task may use; the runner builds one per attempt.

    ``deps``, ``outs`` and ``metrics`` map each declared path to the absolute path to read
    or write: the declared place itself. The runner moved the previous outs aside before
    the task started and puts them back if it fails, so a task writes in place, as any
    script under ``dvc repro`` does. A task finds its paths by name (the spec's
    ``deps: {model: models/xgb.json}``), by the declared path, or, where a stage declares
    one of a kind, with no argument: ``ctx.dep()``, ``ctx.out()``, ``ctx.metric()``.

    A stage that ``needs`` other stages reads their outs and metrics: they are among its
    ``deps`` (as the compiled dvc.yaml lists them). The items of a matrix stage it needs are
    also found per item: ``ctx.items("train")`` (:class:`MatrixItem`, in the matrix's order).
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
    needed: Mapping[str, Mapping[str, MatrixItem]] = field(default_factory=dict)  # matrix stage -> its items
    client: Client | None = None
    executor: Executor | None = None
    n_workers: int = 1
    devices: tuple[int, ...] = ()
    progress: StageProgress = field(default_factory=StageProgress)
    started: float = field(default_factory=time.monotonic)
    # a folder that outlives a stopped attempt (:mod:`conveyor.run.checkpoints`): what a long training
    # saves there, the next attempt with the same inputs finds; None outside a run
    checkpoint_dir: Path | None = None

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

    def items(self, stage: str) -> Mapping[str, MatrixItem]:
        """The items of the matrix stage ``stage`` that this stage needs, by item name
        (``train@0.1-6``), in the matrix's order: ``for it in ctx.items("train").values(): it.out()``."""
        if stage in self.needed:
            return self.needed[stage]
        raise KeyError(f"stage '{self.stage}' needs no matrix stage '{stage}' (it needs: "
                       f"{', '.join(self.needed) or 'none'}); add it to 'needs:' in the spec")

    def report(self, step: int, value: float) -> None:
        """Report an intermediate value (an epoch's validation loss) at ``step``: a search with
        ``--prune`` stops a trial whose values are worse than earlier trials' at that step, by
        raising here (let it propagate). Outside such a search it does nothing."""
        from conveyor.run.reporting import report

        report(self.stage, step, value)

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
        return _pick(self.stage, paths, self.names, name, kind)


def _pick(stage: str, paths: Mapping[str, Path], names: Mapping[str, str], name: str | None, kind: str) -> Path:
    """The path of ``name`` (a name or a declared path) among ``paths``; no name: the only one."""
    if name is None:
        if len(paths) == 1:
            return next(iter(paths.values()))
        raise KeyError(f"stage '{stage}' declares {len(paths)} {kind}: name the one you mean "
                       f"({_listing(paths, names)})")
    declared = names.get(name, name)
    if declared in paths:
        return paths[declared]
    raise KeyError(f"stage '{stage}' has no {kind} entry '{name}' (declared: {_listing(paths, names)})")


def _listing(paths: Mapping[str, Path], names: Mapping[str, str]) -> str:
    named = {path: name for name, path in names.items()}
    return ", ".join(f"{named[p]}: {p}" if p in named else p for p in paths) or "none"


@contextmanager
def current_client(client: Any) -> Iterator[None]:
    """Make ``client`` the one dask computes on, in this stage's thread only.

    ``Client.as_current()`` would also set dask's process-wide ``scheduler`` config and
    restore it on exit; stages running at once exit in any order and would leave it
    wrong for the rest of the process. The context-local client alone is enough:
    with no ``scheduler`` configured, dask asks ``distributed.get_client()``, which returns it.
    """
    from distributed.client import _current_client  # the contextvar behind Client.current()

    token = _current_client.set(client)
    try:
        yield
    finally:
        _current_client.reset(token)
