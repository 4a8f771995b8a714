"""Real components for the task tests: one 2-worker Dask LocalCluster for the session, a
fresh StageBench per test, and one run of the reference chain per test run, shared by the model tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
import pytest
import yaml
from distributed import Client
from projects import once_per_test_run
from stagebench import REPO, StageBench, new_cluster, run_chain

from conveyor.run.context import StageProgress


@pytest.fixture(scope="session")
def client() -> Iterator[Client]:
    """One 2-process Dask cluster for the whole session (starting one costs seconds).

    Not the default scheduler: a test uses it only where it passes it, as the runner does. It
    idles through most of the session: its workers look at their memory each second, not every
    100 ms, and its processes sample the machine's load every 2 s, not 0.5 (idle, 1.3 % of a core
    instead of 3.2; its memory limits are far above what the task tests hold, and the tests of
    memory limits start clusters of their own, with Dask's defaults).
    """
    with dask.config.set({"distributed.worker.memory.monitor-interval": "1s",
                          "distributed.admin.system-monitor.interval": "2s"}):
        cluster = new_cluster()
    with cluster, Client(cluster, set_as_default=False) as dask_client:
        yield dask_client


@pytest.fixture(scope="session")
def params() -> dict[str, Any]:
    """The repository's params.yaml."""
    loaded: dict[str, Any] = yaml.safe_load((REPO / "params.yaml").read_text())
    return loaded


@pytest.fixture
def bench(tmp_path: Path, params: dict[str, Any]) -> StageBench:
    """An empty project root to run tasks in."""
    return StageBench(tmp_path, params)


@pytest.fixture(scope="session")
def chain(tmp_path_factory: pytest.TempPathFactory, params: dict[str, Any],
          request: pytest.FixtureRequest) -> StageBench:
    """The reference chain, run once per test run (:func:`projects.once_per_test_run`) on the session
    cluster of the test process that asks first (the others start no cluster for it); tests read its
    outputs, and the stages' progress as it ended."""
    def run(root: Path) -> dict[str, Any]:
        root.mkdir()
        bench = run_chain(StageBench(root, params), request.getfixturevalue("client"))
        return {"root": str(root), "ran": [[c.stage, c.progress.total, c.progress.completed] for c in bench.contexts]}

    made = once_per_test_run(tmp_path_factory, "chain", run)
    contexts = [Ran(stage, StageProgress(total=total, completed=completed)) for stage, total, completed in made["ran"]]
    return StageBench(Path(made["root"]), params, contexts)  # type: ignore[arg-type]  # Ran: what tests read of one


@dataclass(frozen=True)
class Ran:
    """What the tests read of a chain stage's context (its name, its progress as it ended)."""

    stage: str
    progress: StageProgress
