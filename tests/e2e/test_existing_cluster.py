"""The reference pipeline on a cluster conveyor does not own: `dask scheduler` + two `dask worker`
processes started here on 127.0.0.1, reached through a profile's `address` and `--profile`;
then `conveyor predict` on it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pandas as pd
import pytest
from distributed import Client
from distributed.utils import open_port
from projects import Project, assert_ran_on_remote, evaluated_test_rows
from subprocs import stop_group


@pytest.fixture
def dask_cluster(reference_project: Project, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler and two single-threaded workers, each its own process, started elsewhere with no
    copy of the project and no PYTHONPATH (the project's code travels with the run); stopped at the end."""
    port = open_port("127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path_factory.mktemp("cluster")
    procs = [subprocess.Popen(["dask", "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--dashboard-address", "127.0.0.1:0"], cwd=elsewhere, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    procs += [subprocess.Popen(["dask", "worker", address, "--nthreads", "1", "--memory-limit", "2GiB",
                                "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0", "--name", f"w{i}"],
                               cwd=elsewhere, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True) for i in range(2)]
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):  # workers first, then the scheduler
            stop_group(proc)


@pytest.mark.slow
def test_reference_pipeline_on_an_existing_cluster(reference_project: Project, dask_cluster: str) -> None:
    project = reference_project
    spec = project.root / "configs/pipeline.yaml"
    spec.write_text(spec.read_text().replace(
        '  # remote: {kind: dask, address: "tcp://scheduler:8786"}   # an existing Dask cluster',
        f'  remote: {{kind: dask, address: "{dask_cluster}"}}'))
    assert project.conveyor("validate").returncode == 0
    with Client(dask_cluster) as client:
        before = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
        workers = set(client.scheduler_info(n_workers=-1)["workers"])

    run = project.conveyor("run", "--profile", "cpu=remote", "--profile", "gpu=remote")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on_remote(project)

    with Client(dask_cluster) as client:  # the cluster did the work and is still up, unchanged
        after = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
        assert after - before > 100
        assert set(client.scheduler_info(n_workers=-1)["workers"]) == workers
    assert not project.left_running()  # the run started no process that outlived it

    # predict on the same cluster: the latest run's model (no champion yet) scores the raw rows
    # of the test split exactly as evaluate scored them
    raw = pd.read_parquet(project.root / "data/raw").drop(columns="target")
    raw.insert(0, "id", range(len(raw)))
    raw.to_parquet(project.root / "rows.parquet")
    scored = project.conveyor("predict", "-i", "rows.parquet", "-o", "scores.parquet", "--id", "id",
                              "--profile", "remote")
    assert scored.returncode == 0, scored.stderr
    assert f"scored {len(raw)} rows" in scored.stdout and "(latest run)" in scored.stdout
    scores = pd.read_parquet(project.root / "scores.parquet")
    assert list(scores.columns) == ["id", "score"] and scores["id"].tolist() == list(range(len(raw)))

    ids, evaluated = evaluated_test_rows(project.root, raw)
    assert scores["score"].to_numpy()[ids].tolist() == evaluated
