"""Ingest progress on the stage's live line: MB moved against the total, parts done, the rate."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from conveyor.ingest.units import Block, Shard, Transfer, Unit
from conveyor.run.context import StageProgress

_MB = 1e6


class Meter:
    """Ingest progress on the stage's StageProgress: MB moved as completed/total, and in
    the description the parts done (files, blocks or shards) and the rate."""

    def __init__(self, progress: StageProgress) -> None:
        self.progress = progress
        self.bytes = 0
        self.done = 0
        self.parts = 0
        self.noun = "parts"
        self._sizes: dict[int, int | None] = {}  # each unit's bytes, None while unknown
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def planning(self, sources: int) -> None:
        self.progress.start(None, unit="MB", description=f"listing {sources} source(s)")

    def begin(self, units: Sequence[Unit]) -> None:
        self._sizes = {unit.index: unit.nbytes for unit in units}
        total = self._total()
        nouns = {Block: "blocks", Transfer: "files", Shard: "shards"}
        kinds = {nouns[type(unit)] for unit in units}
        self.parts, self.noun = len(units), kinds.pop() if len(kinds) == 1 else "parts"
        self._started = time.monotonic()
        self.progress.start(total, unit="MB", description=self._describe())

    def announce(self, unit: Unit, nbytes: int | None) -> None:
        """A transfer listed without its size learnt it (the GET's answer): once every size is
        known, the bar has its total."""
        with self._lock:
            if nbytes is None or self._sizes.get(unit.index, 0) is not None:
                return
            self._sizes[unit.index] = nbytes
            total = self._total()
            if total is not None:
                self.progress.total = total

    def _total(self) -> float | None:
        """MB of all units, or None while any unit's size is unknown."""
        sizes = list(self._sizes.values())
        return sum(s for s in sizes if s is not None) / _MB if None not in sizes else None

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n
            self.progress.advance(n / _MB)
            self._show()

    def unit_done(self) -> None:
        with self._lock:
            self.done += 1
            self._show()

    def _show(self) -> None:
        # One reference assignment: the live view reads it whole, before or after.
        self.progress.description = self._describe()

    def _describe(self) -> str:
        rate = self.bytes / _MB / max(time.monotonic() - self._started, 1e-9)
        return f"{self.done}/{self.parts} {self.noun}, {rate:.1f} MB/s"
