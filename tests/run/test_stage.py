"""Stages running at once, each computing on its own Dask client, leave no global state behind."""

from __future__ import annotations

import threading

import dask
import dask.array as da
from distributed import Client, LocalCluster

from conveyor.run.stage import current_client


def test_concurrent_stages_each_use_their_client_and_leave_dask_config_alone() -> None:
    """a enters, b enters, a exits, b exits: the order that broke Client.as_current()."""
    before = dask.config.get("scheduler", None)
    entered, a_done = threading.Barrier(2, timeout=30), threading.Event()
    seen: dict[str, str] = {}
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as one, \
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as two, \
            Client(one, set_as_default=False) as a, Client(two, set_as_default=False) as b:

        def stage(name: str, client: Client) -> None:
            with current_client(client):
                entered.wait()
                if name == "b":
                    assert a_done.wait(30)
                assert int(da.ones(10, chunks=5).sum().compute()) == 10
                seen[name] = Client.current().scheduler.address
            if name == "a":
                a_done.set()

        threads = [threading.Thread(target=stage, args=(n, c)) for n, c in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert seen == {"a": one.scheduler_address, "b": two.scheduler_address}
    assert dask.config.get("scheduler", None) == before
    assert int(da.ones(4, chunks=2).sum().compute()) == 4  # no client: the local scheduler, not an error
