"""The watch that fails a stage whose cluster has had no worker too long, on a real LocalCluster
whose workers the test takes away."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from distributed import Client, LocalCluster

from conveyor.run.profiles import Resources
from conveyor.run.workers import NoWorkers, WorkerWatch


def busy(seconds: float) -> None:
    """A stage's wait, in Python steps (as a command's wait is): the watch's exception lands in it."""
    done = threading.Event()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done.wait(0.05)


@pytest.mark.slow
def test_a_stage_fails_once_its_cluster_has_had_no_worker_for_the_bound() -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,  # in-process: no socket
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster, set_as_default=False) as client:
        resources = Resources(profile="remote", client=client, external=True, no_workers_timeout_s=1.0)
        with WorkerWatch("fine", resources):  # workers all along: the stage ends as it would have
            busy(2.0)

        cluster.scale(0)
        while client.nthreads():
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(NoWorkers) as caught, WorkerWatch("gone", resources):
            busy(60)
        assert time.monotonic() - t0 < 5
        assert str(caught.value) == (
            f"stage 'gone' failed: the Dask scheduler at {cluster.scheduler_address} (profile 'remote') has had no "
            "workers for 1s (no_workers_timeout_s): its workers died or were stopped; start workers for it and "
            "run again (what succeeded is skipped)")

        # a task that catches every Exception still fails: the watch says so as the stage ends
        with pytest.raises(NoWorkers), WorkerWatch("swallows", resources), contextlib.suppress(Exception):
            busy(60)


def test_a_stage_not_on_a_cluster_is_not_watched() -> None:
    watch = WorkerWatch("stage", Resources(profile="remote", client=None, no_workers_timeout_s=1.0))
    assert watch.timeout_s is None  # not on a cluster: nothing to watch
