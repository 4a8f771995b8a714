"""The Dask workers a stage holds for its ``resources:`` (``{GPU: 1}``), while it runs.

Dask's resources are per task: a worker started with ``--resources GPU=1`` runs one task asking
for ``GPU: 1`` at a time. A stage is more than one task: a training submits many, and
xgboost.dask or a DDP job takes every worker it is given. So conveyor holds whole workers for a
stage: before it starts, the stage takes workers whose declared resources are free in this run,
and everything it sends the cluster is restricted to them (``dask.annotate(workers=...)``, in the
stage's thread only: Dask's annotations are a context variable), until it ends. Two stages (two
items of a sweep) never hold the same unit of a resource; a stage waits while they are taken.

- A task stage asking ``{GPU: k}`` holds workers until it has k units (one worker per GPU, as
  dask-cuda starts them, gives k workers): xgboost.dask and DDP then run on exactly those.
- A command runs on one worker: it holds one that has the whole amount.

The holds are this run's: two runs sharing a cluster do not see each other's (a command also asks
Dask for the resources, so the cluster's scheduler keeps those apart).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.errors import StageError

if TYPE_CHECKING:
    from distributed import Client

_HELD: ContextVar[tuple[str, ...] | None] = ContextVar("conveyor_held_workers", default=None)
POLL_S = 0.5


def held_workers() -> tuple[str, ...] | None:
    """The workers the current stage holds (None: it holds none, every worker is its)."""
    return _HELD.get()


@dataclass(frozen=True)
class Hold:
    """Workers held by one stage, and what it took on each (worker -> resource -> amount)."""

    stage: str
    taken: Mapping[str, Mapping[str, float]]

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(sorted(self.taken))


class Holdings:
    """The resources of one cluster's workers that this run's stages hold."""

    def __init__(self, client: Client, profile: str) -> None:
        self.client = client
        self.profile = profile
        self._taken: dict[str, dict[str, float]] = {}  # worker -> resource -> amount held
        self._changed = threading.Condition()

    def declared(self) -> dict[str, dict[str, float]]:
        """Each worker's declared resources (``dask worker --resources``), by address."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {address: {k: float(v) for k, v in (worker.get("resources") or {}).items()}
                for address, worker in info.items()}

    def take(self, stage: str, needs: Mapping[str, float], one_worker: bool) -> Hold:
        """Hold workers with ``needs`` free; waits while other stages of the run hold them."""
        with self._changed:
            while True:
                declared = self.declared()
                self._impossible(stage, needs, one_worker, declared)
                taken = _fit(needs, one_worker, declared, self._taken)
                if taken is not None:
                    for worker, amounts in taken.items():
                        held = self._taken.setdefault(worker, {})
                        for name, amount in amounts.items():
                            held[name] = held.get(name, 0.0) + amount
                    return Hold(stage, taken)
                self._changed.wait(POLL_S)  # short steps: workers join, and Ctrl-C lands between them

    def give_back(self, hold: Hold) -> None:
        with self._changed:
            for worker, amounts in hold.taken.items():
                held = self._taken.get(worker, {})
                for name, amount in amounts.items():
                    held[name] = max(0.0, held.get(name, 0.0) - amount)
            self._changed.notify_all()

    def _impossible(self, stage: str, needs: Mapping[str, float], one_worker: bool,
                    declared: Mapping[str, Mapping[str, float]]) -> None:
        """A stage no set of the cluster's workers can ever hold fails now, saying why (with no
        workers at all it waits: the cluster may be starting, and the run's watch bounds that)."""
        if not declared:
            return
        for name, amount in needs.items():
            have = [resources.get(name, 0.0) for resources in declared.values()]
            enough = max(have) >= amount if one_worker else sum(have) >= amount
            if not enough:
                where = "one worker" if one_worker else "its workers together"
                raise StageError(stage, f"it needs {name}={amount:g} on {where}, and the workers of profile "
                                        f"'{self.profile}' declare {name}={max(have) if one_worker else sum(have):g}"
                                        f" (start them with --resources {name}=N, or a profile's resources:)")


def _fit(needs: Mapping[str, float], one_worker: bool, declared: Mapping[str, Mapping[str, float]],
         taken: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]] | None:
    """What to take from which workers for ``needs`` (None: not free now). Workers in address
    order, each taken whole for the resources it has free, until the needs are met."""
    free = {worker: {name: resources.get(name, 0.0) - taken.get(worker, {}).get(name, 0.0) for name in needs}
            for worker, resources in sorted(declared.items())}
    if one_worker:
        for worker, has in free.items():
            if all(has[name] >= amount for name, amount in needs.items()):
                return {worker: dict(needs)}
        return None
    left = dict(needs)
    chosen: dict[str, dict[str, float]] = {}
    for worker, has in free.items():
        useful = {name: min(has[name], left[name]) for name in left if left[name] > 0 and has[name] > 0}
        if not useful:
            continue
        chosen[worker] = useful
        for name, amount in useful.items():
            left[name] -= amount
        if all(amount <= 1e-9 for amount in left.values()):
            return chosen
    return None


@contextmanager
def holding(holdings: Holdings | None, stage: str, needs: Mapping[str, float] | None,
            one_worker: bool) -> Iterator[Hold | None]:
    """The stage's workers held for the block, and what it sends the cluster restricted to them."""
    if holdings is None or not needs:
        yield None
        return
    from dask.base import annotate

    hold = holdings.take(stage, needs, one_worker)
    token = _HELD.set(hold.workers)
    try:
        with annotate(workers=list(hold.workers), allow_other_workers=False):
            yield hold
    finally:
        _HELD.reset(token)
        holdings.give_back(hold)


def names(client: Any, workers: tuple[str, ...]) -> list[str]:
    """The workers' names (what a record shows), else their addresses."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return [str(info.get(worker, {}).get("name", worker)) for worker in workers]
