"""A ``conveyor run``'s flow run ends without waiting for Prefect's heartbeat thread.

With a configured server, Prefect (3.9: ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, 180 s unless set)
sends a flow run's heartbeats from a thread that sleeps in steps of a second, and a synchronous
flow run joins it as it ends: the end waits out the step under way, most of a second for a short
run (a forced one-stage run took 1.2 s against a configured server, 0.3 s against conveyor's
local one, which gets no heartbeats: :mod:`conveyor.prefect.server`). Prefect's asynchronous flow
runs do not join it (``join_on_exit=False``): the thread sees the stop within that second and
ends by itself, sending nothing more. ``conveyor run`` ends its flow runs that way too; the
heartbeats themselves are unchanged. Where Prefect's function is not the one this was written
for, nothing is changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_UNJOINED = "__conveyor_unjoined__"


def unjoined() -> None:
    """Make the flow engine's heartbeat context leave its thread to end by itself (once per process)."""
    from prefect import flow_engine

    send: Callable[..., Any] | None = getattr(flow_engine, "_send_heartbeats", None)
    if send is None or getattr(send, _UNJOINED, False) or "join_on_exit" not in inspect.signature(send).parameters:
        return
    original = send

    def unjoined_heartbeats(engine: Any, join_on_exit: bool = True) -> Any:
        return original(engine, join_on_exit=False)

    setattr(unjoined_heartbeats, _UNJOINED, True)
    flow_engine._send_heartbeats = unjoined_heartbeats
