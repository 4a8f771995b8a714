"""The kept Prefect server's process: Prefect's API under uvicorn, gone after an idle time.

Started by :mod:`conveyor.prefect.kept` as ``python -m conveyor.prefect.keeper DIR PORT IDLE_S``,
in a session of its own, so that it outlives the run that started it and the later runs of the
same ``PREFECT_HOME`` record in it without paying a server's start. It serves Prefect's ephemeral
app (no UI, no scheduler: as the temporary server of a run) on 127.0.0.1 only, writes
``DIR/server.json`` once it answers, and ends by itself when nothing has used it for ``IDLE_S``
seconds: no run holds a lease (``DIR/leases/*``, each flock'ed by its run for the run's length; the
kernel lets go of it when the run dies, even by kill -9) and no request came in. ``SIGTERM``
(``conveyor server stop``) ends it at once. Either way it removes its ``server.json`` first, under
the gate (``DIR/gate``), so no run joins a server on its way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

CHECK_EVERY_S = 1.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Touched:
    """An ASGI app that notes when it last had a request (a user's ``prefect`` CLI, the UI of a
    profile pointed here) before passing it on: such use keeps the server as a run's lease does."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.last = time.monotonic()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.last = time.monotonic()
        await self.app(scope, receive, send)


def live_leases(directory: Path) -> list[int]:
    """The pids of the runs holding a lease; a lease whose run died is removed. Only under the gate
    (exclusive), so that no run is between creating its lease file and locking it."""
    pids = []
    for lease in sorted((directory / "leases").glob("*")):
        with contextlib.suppress(OSError), lease.open("a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pids.append(int(lease.name.split("-")[0]) if lease.name.split("-")[0].isdigit() else 0)
                continue
            lease.unlink()
    return pids


def remove_state(directory: Path, pid: int) -> None:
    """``server.json``, when it still names ``pid`` (a server started since keeps its own)."""
    state = directory / "server.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(state.read_text(encoding="utf-8")).get("pid") == pid:
            state.unlink()


def write_state(directory: Path, port: int, idle_s: float) -> None:
    from importlib.metadata import version

    state = {"pid": os.getpid(), "port": port, "url": f"http://127.0.0.1:{port}/api", "idle_s": idle_s,
             "started": time.time(), "prefect": version("prefect"), "python": sys.executable,
             "database": os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or "sqlite (PREFECT_HOME/prefect.db)"}
    partial = directory / f"server.json.{os.getpid()}"
    partial.write_text(json.dumps(state, indent=1), encoding="utf-8")
    partial.replace(directory / "server.json")


def _closed_if_idle(directory: Path, app: Touched, idle_s: float, active: list[float]) -> bool:
    """Whether the server is idle past ``idle_s``; then its state is gone when this returns (under the
    gate) and no run can join it any more. ``active``: when a lease was last seen held."""
    try:
        opened = (directory / "gate").open("a")
    except OSError:  # its folder is gone (PREFECT_HOME removed): no run can find it, none can lease it;
        return time.monotonic() - max(active[0], app.last) >= idle_s  # it stops once no request came for a while
    with opened as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a run is joining: it is not idle
            active[0] = time.monotonic()
            return False
        if live_leases(directory):
            active[0] = time.monotonic()
            return False
        if time.monotonic() - max(active[0], app.last) < idle_s:
            return False
        remove_state(directory, os.getpid())
        return True


async def _watch(server: Any, directory: Path, port: int, app: Touched, idle_s: float) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    write_state(directory, port, idle_s)
    active = [time.monotonic()]
    while not server.should_exit:
        await asyncio.sleep(min(CHECK_EVERY_S, idle_s / 4))
        if _closed_if_idle(directory, app, idle_s, active):
            print(f"conveyor: the kept Prefect server stops after {idle_s:g} s unused", file=sys.stderr, flush=True)
            server.should_exit = True


async def _serve(directory: Path, port: int, idle_s: float) -> None:
    import uvicorn
    from prefect.server.api.server import create_app

    app = Touched(create_app(ephemeral=True, final=True))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    watch = asyncio.create_task(_watch(server, directory, port, app, idle_s))
    try:
        await server.serve()
    finally:
        watch.cancel()


def main(argv: list[str]) -> int:
    directory, port, idle_s = Path(argv[1]), int(argv[2]), float(argv[3])
    try:
        asyncio.run(_serve(directory, port, idle_s))
    finally:
        with contextlib.suppress(OSError), (directory / "gate").open("a") as gate:  # a run reading the
            fcntl.flock(gate, fcntl.LOCK_EX)  # state waits for its removal (none where the folder is gone)
            remove_state(directory, os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
