"""``conveyor server status|stop``: the Prefect server conveyor keeps between runs."""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer

from conveyor.cli.common import app, out

server_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="The local Prefect server conveyor keeps between runs (no PREFECT_API_URL set), "
                              "and its warm runners.")
app.add_typer(server_app, name="server")


def kept_line() -> str | None:
    """One line on the kept server of this PREFECT_HOME, or None when none runs (``conveyor runs``)."""
    from conveyor.prefect.kept import prefect_home, seen

    shown = seen(prefect_home() / "conveyor-server")
    if shown is None:
        return None
    state = shown.state
    using = f", {len(shown.runs)} run(s) using it" if shown.runs else ""
    return (f"Prefect server: kept at {state.url} (pid {state.pid}{using}; stops after {_span(state.idle_s)} "
            "unused; `conveyor server stop` stops it now)")


@server_app.command()
def status() -> None:
    """Whether a kept server runs for this PREFECT_HOME: its URL, pid, the runs using it, its idle stop;
    and the warm runners that start runs without importing Prefect each time."""
    _server_status()
    out.print(_warm_line(), highlight=False, soft_wrap=True)


def _warm_line() -> str:
    from conveyor.cli.warm_state import runners

    found = runners()
    if not found:
        return ("warm runners:  none (the next `conveyor run` starts one, which forks it and the runs after it; "
                "CONVEYOR_WARM=0: none)")
    pids = ", ".join(f"{r.pid}{' starting' if r.served < 0 else ''}" for r in found)
    learned = list(dict.fromkeys(name for r in found for name in r.learned))
    held = f"; imported for their runs: {', '.join(learned)}" if learned else ""
    return (f"warm runners:  {len(found)} (pid {pids}; each stops after {_span(found[0].idle_s)} unused{held}; "
            "`conveyor server stop` stops them)")


def _server_status() -> None:
    from conveyor.prefect.kept import idle_s, prefect_home, seen

    if os.environ.get("PREFECT_API_URL"):
        out.print(f"PREFECT_API_URL is set ({os.environ['PREFECT_API_URL']}): runs record there, conveyor keeps "
                  "no server", highlight=False, soft_wrap=True)
        return
    directory = prefect_home() / "conveyor-server"
    shown = seen(directory)
    if shown is None:
        idle = idle_s()
        then = (f"keeps it {_span(idle)} after its last run" if idle
                else "stops it with the run (CONVEYOR_SERVER_IDLE=0)")
        out.print(f"no Prefect server kept for PREFECT_HOME={prefect_home()}: the next run starts one and {then}",
                  highlight=False, soft_wrap=True)
        return
    state = shown.state
    runs = f"{len(shown.runs)} (pid {', '.join(map(str, shown.runs))})" if shown.runs else "none"
    for name, value in [("url", state.url), ("pid", str(state.pid)), ("up", _span(time.time() - state.started)),
                        ("runs using it", runs), ("stops after", f"{_span(state.idle_s)} unused"),
                        ("prefect", state.prefect), ("log", str(directory / "server.log"))]:
        out.print(f"{name + ':':15}{value}", highlight=False, soft_wrap=True)


@server_app.command()
def stop(
    force: Annotated[bool, typer.Option("--force", help="Stop it even while runs use it (they fail for "
                                                        "their server; their stages keep their outcome).")] = False,
) -> None:
    """Stop the kept server now (refused while runs use it, unless --force), and the warm runners (each
    once the runs it started have ended); the next run starts others."""
    from conveyor.cli.warm_state import stop_all
    from conveyor.prefect.kept import prefect_home
    from conveyor.prefect.kept import stop as stop_server

    warm = stop_all()
    if warm:
        out.print(f"stopping {len(warm)} warm runner(s) (pid {', '.join(str(r.pid) for r in warm)}): each ends once "
                  "the runs it started have", highlight=False, soft_wrap=True)
    stopped = stop_server(prefect_home() / "conveyor-server", force)
    if stopped is None:
        out.print("no Prefect server kept: nothing to stop", highlight=False)
    else:
        out.print(f"stopped the kept Prefect server (pid {stopped.state.pid}, {stopped.state.url})", highlight=False)


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
