"""Real components for the task tests: one 2-worker Dask LocalCluster for the session, a
fresh StageBench per test, and one run of the reference chain shared by the model tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from distributed import Client
from stagebench import REPO, StageBench, new_cluster, run_chain


@pytest.fixture(scope="session")
def client() -> Iterator[Client]:
    """One 2-process Dask cluster for the whole session (starting one costs seconds).

    Not the default scheduler: a test uses it only where it passes it, as the runner does.
    """
    with new_cluster() as cluster, Client(cluster, set_as_default=False) as dask_client:
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
def chain(tmp_path_factory: pytest.TempPathFactory, params: dict[str, Any], client: Client) -> StageBench:
    """The reference chain, run once on the session cluster; tests read its outputs."""
    return run_chain(StageBench(tmp_path_factory.mktemp("chain"), params), client)
