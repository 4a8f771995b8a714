"""Real components for the task tests: one 2-worker Dask LocalCluster for the session, a
fresh StageBench per test, and one run of the reference chain per test run, shared by the model tests.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
import pytest
import yaml
from distributed import Client
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
    """The reference chain, run once per test run on the session cluster of the test process that
    asks first (the others wait for it on a lock in the test run's folder, as for ``first_run``,
    and start no cluster for it); tests read its outputs, and the stages' progress as it ended."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the test run's folder, which holds each test process's own
    root, ran = shared / "chain", shared / "chain.json"
    with (shared / "chain.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the process that runs it is done
        if not ran.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a process interrupted while running it left
            root.mkdir()
            bench = run_chain(StageBench(root, params), request.getfixturevalue("client"))
            ran.write_text(json.dumps([[c.stage, c.progress.total, c.progress.completed] for c in bench.contexts]))
    contexts = [Ran(stage, StageProgress(total=total, completed=completed))
                for stage, total, completed in json.loads(ran.read_text())]
    return StageBench(root, params, contexts)  # type: ignore[arg-type]  # Ran: what tests read of a context


@dataclass(frozen=True)
class Ran:
    """What the tests read of a chain stage's context (its name, its progress as it ended)."""

    stage: str
    progress: StageProgress
