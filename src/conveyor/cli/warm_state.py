"""The warm runners' state files (:mod:`conveyor.cli.warm_runner`): where they are, what each says,
and stopping them all, for ``conveyor server status`` and ``conveyor server stop``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from conveyor.prefect.kept import prefect_home


def directory(home: Path | None = None) -> Path:
    """Where the warm runners of ``home`` (this process's PREFECT_HOME by default) keep their files."""
    return (home or prefect_home()) / "conveyor-server" / "warm"


@dataclass(frozen=True)
class Runner:
    """A warm runner as its state file says (for ``conveyor server status|stop``)."""

    key: str
    pid: int
    started: float
    idle_s: float
    served: int
    used: float
    learned: tuple[str, ...] = ()

    @classmethod
    def read(cls, path: Path) -> Runner | None:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls(path.stem, int(raw["pid"]), float(raw["started"]), float(raw["idle_s"]), int(raw["served"]),
                       path.stat().st_mtime, tuple(map(str, raw.get("learned", ()))))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def runners(home: Path | None = None) -> list[Runner]:
    """The warm runners of ``home`` (this ``PREFECT_HOME`` by default) that still run, the most recently
    used first."""
    found = [r for p in directory(home).glob("*.json") if (r := Runner.read(p)) is not None and _is_runner(r)]
    return sorted(found, key=lambda r: -r.used)


def _is_runner(runner: Runner) -> bool:
    try:
        with open(f"/proc/{runner.pid}/cmdline", "rb") as f:
            line = f.read()
    except OSError:
        return False
    # a task's runner works its key out itself (conveyor.cli.warm.spawn_task_runner)
    return b"conveyor.cli.warm_runner" in line and (runner.key.encode() in line or b"task=True" in line)


def stop_all() -> list[Runner]:
    """SIGTERM every warm runner of this ``PREFECT_HOME`` (each ends once its runs have): those signalled."""
    stopped = []
    for runner in runners():
        with contextlib.suppress(ProcessLookupError):
            os.kill(runner.pid, signal.SIGTERM)
            stopped.append(runner)
    return stopped
