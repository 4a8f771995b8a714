"""A `conveyor run`'s flow run still sends Prefect's heartbeats, and its end does not wait for the
thread that sends them (conveyor.prefect.heartbeats)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from prefect import flow_engine

from conveyor.prefect import heartbeats


class Engine:
    """What Prefect's heartbeat context reads of its flow run engine; the heartbeats it emits."""

    heartbeat_seconds = 30
    flow_run = None
    logger = logging.getLogger("test-heartbeats")

    def __init__(self) -> None:
        self.emitted = threading.Event()

    def _build_heartbeat_event_template(self) -> tuple[Any, Any]:
        return {}, []

    def _emit_flow_run_heartbeat(self, resource: Any, related: Any) -> None:
        self.emitted.set()


def test_the_heartbeats_go_on_and_the_end_does_not_wait_for_their_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow_engine, "_send_heartbeats", flow_engine._send_heartbeats)  # put back after
    heartbeats.unjoined()
    heartbeats.unjoined()  # once: not wrapped twice
    engine = Engine()
    before = set(threading.enumerate())
    with flow_engine._send_heartbeats(engine):
        assert engine.emitted.wait(30), "no heartbeat sent"
        [thread] = [t for t in set(threading.enumerate()) - before if t.name.endswith("(run)")]  # its Context.run
    assert thread.is_alive()  # not joined: asleep in its second (Prefect's join waited it out)
    thread.join(30)  # it sees the stop within that second and ends by itself
    assert not thread.is_alive()
