"""The run record of SPEC.md section 5: what ran, how long, and what parallelism bought.

``speedup`` is the sum of stage durations over the wall time; ``critical_path_s`` is the
longest dependent chain, the Amdahl bound no executor can beat.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from conveyor.plan import dag
from conveyor.run.schedule import Outcome
from conveyor.workspace import STATE_DIR, state_dir


def now() -> datetime:
    return datetime.now(UTC)


def new_run_id() -> str:
    return f"{now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass
class StageRecord:
    """How one stage went in one run."""

    status: str = Outcome.NOT_RUN.value
    profile: str | None = None
    attempts: int = 0
    reason: str = ""
    started: str | None = None
    finished: str | None = None
    duration_s: float = 0.0
    error: str | None = None
    trace: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # from its declared metrics files


@dataclass
class RunRecord:
    """One ``conveyor run``, written to ``.conveyor/runs/<run_id>.json`` and ``latest.json``."""

    run_id: str
    pipeline: str
    status: str = "running"
    started: str = field(default_factory=lambda: now().isoformat())
    finished: str | None = None
    wall_s: float = 0.0
    stages: dict[str, StageRecord] = field(default_factory=dict)
    critical_path: list[str] = field(default_factory=list)
    critical_path_s: float = 0.0
    stage_sum_s: float = 0.0
    speedup: float = 0.0
    flow_run_id: str | None = None
    flow_run_url: str | None = None  # in the Prefect UI, when a server is configured

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.status == Outcome.FAILED.value]

    @property
    def not_run(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.status == Outcome.NOT_RUN.value]

    def close(self, graph: dag.Graph, wall_s: float) -> None:
        """Fill in the totals once every stage has ended."""
        self.finished = now().isoformat()
        self.wall_s = round(wall_s, 3)
        self.status = "failed" if self.failed or self.not_run else "succeeded"
        durations = {n: s.duration_s for n, s in self.stages.items()}
        sub = {n: frozenset(u for u in graph[n] if u in durations) for n in durations}
        self.critical_path, cp = dag.critical_path(sub, durations)
        self.critical_path_s = round(cp, 3)
        self.stage_sum_s = round(sum(durations.values()), 3)
        self.speedup = round(self.stage_sum_s / self.wall_s, 3) if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        body = dict(data)
        body["stages"] = {n: StageRecord(**s) for n, s in body.get("stages", {}).items()}
        return cls(**body)

    def write(self, root: Path) -> Path:
        """Write this record and point latest.json at it; both writes are atomic."""
        path = record_path(root, self.run_id)
        folder = path.parent
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2)
        for target in (path, folder / "latest.json"):
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(text + "\n", encoding="utf-8")
            os.replace(tmp, target)
        return path


def record_path(root: Path, run_id: str) -> Path:
    return state_dir(root) / "runs" / f"{run_id}.json"


def read_latest(root: Path) -> RunRecord | None:
    path = root / STATE_DIR / "runs" / "latest.json"
    if not path.exists():
        return None
    return RunRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
