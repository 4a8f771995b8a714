"""The one scheduling loop's state: which stages may start now, and how each one ended.

Events in (a stage finished, with its outcome), work out (the stages now ready): no
clocks, no threads, no I/O, so it is tested on small hand-drawn DAGs. The Prefect flow
and ``conveyor exec`` drive it; see :mod:`conveyor.prefect.flow`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from conveyor.plan.dag import Graph, closure, downstream_graph, topological_order


class Outcome(StrEnum):
    """How a stage ended in one run (SPEC.md section 5)."""

    SUCCEEDED = "succeeded"
    SKIPPED = "skipped"
    FAILED = "failed"
    NOT_RUN = "not_run"


@dataclass
class Schedule:
    """Which stages may start now: the one scheduling loop's state, events in, work out.

    Stages outside ``selected`` count as satisfied. A failure marks every stage downstream
    of it ``not_run``; independent branches go on. A stage waits for room in its pool
    (``pool_of``, ``limits``: e.g. local commands, as many at once as there are cores).

        a ──► b ──► d        a fails → b, d not run; c still runs
        └───► c
    """

    graph: Graph
    selected: set[str]
    order: list[str] = field(default_factory=list)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    # how many stages of one pool may run at once (a pool absent here: no limit)
    pool_of: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.order:
            self.order = topological_order(self.graph)
        self.order = [n for n in self.order if n in self.selected]

    def ready(self) -> list[str]:
        """Stages whose upstream all succeeded or were skipped, not yet started, with room in
        their pool (in order); marks them started."""
        ok = {Outcome.SUCCEEDED, Outcome.SKIPPED}
        busy = Counter(self.pool_of.get(name, "") for name in self.running)
        ready = []
        for name in self.order:
            if name in self.started or not all(u not in self.selected or self.outcomes.get(u) in ok
                                                for u in self.graph[name]):
                continue
            pool = self.pool_of.get(name, "")
            if pool in self.limits and busy[pool] >= self.limits[pool]:
                continue
            busy[pool] += 1
            ready.append(name)
        self.started.update(ready)
        return ready

    def finish(self, stage: str, outcome: Outcome) -> list[str]:
        """Record how ``stage`` ended; returns the stages that will now never run."""
        self.outcomes[stage] = outcome
        if outcome is not Outcome.FAILED:
            return []
        down = closure(downstream_graph(self.graph), [stage]) - {stage}
        lost = [n for n in self.order if n in down and n not in self.started]
        for name in lost:
            self.outcomes[name] = Outcome.NOT_RUN
            self.started.add(name)
        return lost

    @property
    def running(self) -> set[str]:
        return self.started - set(self.outcomes)

    @property
    def finished(self) -> bool:
        return all(name in self.outcomes for name in self.order)
