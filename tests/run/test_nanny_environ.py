"""Dask's nannies set OMP_NUM_THREADS=1 &c. on the runner's os.environ; workers keep them, nothing else does.

A real LocalCluster (worker process, spawned) started through the profile code path, a real
worker restart (which makes the nanny write the variables again), and a real command run
through commands.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conveyor.run.commands import Command, run_here
from conveyor.run.profiles import Profiles
from conveyor.spec.profiles import DaskProfile

CPU = DaskProfile(kind="dask", n_workers=1, threads_per_worker=1, processes=True, memory_limit="1GiB")
DASKS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")


def command_environ(tmp_path: Path, **env: str) -> dict[str, str]:
    """The environment a command stage run here sees (as ``env`` prints it)."""
    out: list[str] = []
    finished = run_here(Command("stage", ("env",), cwd=str(tmp_path), env=env),
                        lambda stream, line: out.append(line) if stream == "out" else None)
    assert finished.returncode == 0, finished.stderr_tail
    return dict(line.split("=", 1) for line in out if "=" in line)


def worker_environ() -> dict[str, str]:
    return {name: os.environ.get(name, "unset") for name in DASKS}


@pytest.mark.slow
@pytest.mark.parametrize("users_omp", [None, "3"])
def test_a_local_cluster_leaves_the_runners_environment_as_the_user_set_it(
        users_omp: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*DASKS, "PYTHONHASHSEED", "__DASK_PARENT_PID"):
        monkeypatch.delenv(name, raising=False)
    if users_omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", users_omp)
    users = {name: os.environ.get(name) for name in (*DASKS, "PYTHONHASHSEED", "__DASK_PARENT_PID")}

    with Profiles({"cpu": CPU}) as profiles:
        client = profiles.get("cpu").client
        assert client is not None
        # the worker has Dask's settings (a value the user set wins, as Dask does it) ...
        omp = users_omp or "1"
        expected = {"OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                    "MALLOC_TRIM_THRESHOLD_": "65536"}
        assert list(client.run(worker_environ).values()) == [expected]
        # ... the runner's process does not
        assert {name: os.environ.get(name) for name in users} == users
        seen = command_environ(tmp_path)
        assert {name: seen.get(name) for name in users} == users

        client.restart(timeout=60)  # the nanny spawns a new worker: it writes them into os.environ again
        assert os.environ.get("MKL_NUM_THREADS") == "1"  # Dask's doing, not conveyor's to take back here
        seen = command_environ(tmp_path)
        assert {name: seen.get(name) for name in users} == users
        assert command_environ(tmp_path, OMP_NUM_THREADS="7")["OMP_NUM_THREADS"] == "7"  # a stage's env wins
        assert list(client.run(worker_environ).values()) == [expected]


@pytest.mark.slow
def test_a_profiles_worker_env_is_set_before_the_workers_start_and_removes_dasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*DASKS, "CONVEYOR_TEST_WORKER"):
        monkeypatch.delenv(name, raising=False)
    tuned = CPU.model_copy(update={"worker_env": {"MALLOC_TRIM_THRESHOLD_": None, "CONVEYOR_TEST_WORKER": 7}})

    with Profiles({"cpu": tuned}) as profiles:
        client = profiles.get("cpu").client
        assert client is not None
        seen = list(client.run(lambda: {name: os.environ.get(name, "unset")
                                        for name in (*DASKS, "CONVEYOR_TEST_WORKER")}).values())

    assert seen == [{"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "MALLOC_TRIM_THRESHOLD_": "unset", "CONVEYOR_TEST_WORKER": "7"}]
    assert "CONVEYOR_TEST_WORKER" not in os.environ  # the runner's own environment is as it was
