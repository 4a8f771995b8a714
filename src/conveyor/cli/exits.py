"""How the ``conveyor`` process ends: at once where waiting would be for nothing, and with one
line for a usage error."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import typer

# imported: tearing the modules down takes seconds (DVC's: 0.3 s of a 1.4 s no-op run of 51 stages)
_SLOW_TEARDOWN = ("torch", "prefect", "distributed", "xgboost", "dvc")


def exit_now(code: int) -> NoReturn:
    """Exit with ``code``; without waiting for the thread of a stage abandoned at its timeout
    (blocked in a C call: its outs were put back and its record written), nor for Prefect's
    workers to send what they hold to a server that stopped answering (they would for minutes).

    Once torch, Prefect, Dask, XGBoost or DVC are imported, the exit is the interpreter's own
    minus its last step: threads are joined and every exit handler runs (Prefect's,
    logging's, multiprocessing's, thread pools'), then the process ends without tearing its
    modules down, which after a run takes 0.3-2 s and keeps nothing.
    """
    from conveyor.prefect.server import lost
    from conveyor.run.watchdog import stuck

    if stuck() or lost():  # a blocked stage's thread; Prefect's workers waiting on a server that is gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if not any(name in sys.modules for name in _SLOW_TEARDOWN):
        sys.exit(code)
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def usage_error(exc: typer.TyperException) -> NoReturn:
    """One line (did-you-mean included where click has one) and exit 2; no arguments at all shows the help."""
    message = exc.format_message().strip()
    if message.startswith("Usage:"):  # a command given without arguments: its help
        print(message, file=sys.stderr)
        sys.exit(2)
    command = str(getattr(getattr(exc, "ctx", None), "command_path", None) or "conveyor")
    option, possible = getattr(exc, "option_name", None), getattr(exc, "possibilities", None)
    if option and possible:  # click lists every close option; name the closest, as the spec errors do
        from conveyor.errors import did_you_mean

        message = f"No such option: {option}{did_you_mean(option, possible)}"
    line = " ".join(message.split())
    print(f"{command}: {line} (see '{command} --help')", file=sys.stderr)
    sys.exit(getattr(exc, "exit_code", 2) or 2)
