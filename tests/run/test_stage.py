"""The stage runner's pieces: outs checked after a stage, and Dask clients that leave no global state."""

from __future__ import annotations

import threading
from pathlib import Path

import dask
import dask.array as da
import pytest
from distributed import Client, LocalCluster

from conveyor.errors import MissingOutputError
from conveyor.run.failures import short_error
from conveyor.run.stage import check_outs, current_client


def test_concurrent_stages_each_use_their_client_and_leave_dask_config_alone() -> None:
    """a enters, b enters, a exits, b exits: the order that broke Client.as_current()."""
    before = dask.config.get("scheduler", None)
    entered, a_done = threading.Barrier(2, timeout=30), threading.Event()
    seen: dict[str, str] = {}
    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as one, \
            LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as two, \
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


def test_a_declared_out_the_stage_did_not_write_is_named_with_where_it_was_expected(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models/a.json").write_text("{}")
    with pytest.raises(MissingOutputError) as info:
        check_outs(tmp_path, "train", ["models/a.json", "metrics/b.json", "data/c"])
    assert str(info.value) == (f"stage 'train' failed: did not write its declared outs: 'metrics/b.json' (expected "
                               f"at {tmp_path / 'metrics/b.json'}), 'data/c' (expected at {tmp_path / 'data/c'})")
    with pytest.raises(MissingOutputError, match=r"did not write its declared out 'data/c' \(expected at "):
        check_outs(tmp_path, "train", ["data/c"])


def test_a_stage_error_names_what_caused_it_and_what_a_cluster_lacks() -> None:
    def deserialize() -> None:
        try:
            raise ModuleNotFoundError("No module named 'mypkg'")
        except ModuleNotFoundError as exc:  # what distributed raises when a scheduler cannot unpickle a task
            raise RuntimeError("Error during deserialization of the task graph. This frequently\noccurs if "
                               "the Scheduler and Client have different environments.") from exc

    with pytest.raises(RuntimeError) as info:
        deserialize()
    line = short_error(info.value)
    assert line.startswith("RuntimeError: Error during deserialization of the task graph. This frequently "
                           "(caused by ModuleNotFoundError: No module named 'mypkg'); the Dask scheduler or "
                           "workers cannot import code the task sends them from outside the project")
    assert short_error(ValueError("bad\nsecond line")) == "ValueError: bad"
