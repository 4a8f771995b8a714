"""The Dask workers a stage runs on: can they import the project, why did they die, and
restarting them after an attempt that may have left them blocked or broken.

Prefect-free and free of heavy imports: only the started profile's client is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import StageError
from conveyor.run.nanny_env import undo_nanny_environ

if TYPE_CHECKING:
    from distributed import Client

    from conveyor.run.profiles import Resources


def workers_lacking(client: Client, package: str) -> list[str]:
    """The workers of ``client``'s cluster that cannot find ``package`` (a worker that fails to
    unpickle a task closes its connection, and Dask waits for workers that never come)."""
    import importlib.util

    found = client.run(importlib.util.find_spec, package, on_error="return")
    return sorted(worker for worker, spec in found.items() if spec is None or isinstance(spec, BaseException))


def check_importable(stage: str, resources: Resources, package: str, root: Path) -> None:
    """The workers can import the task's ``package`` (what the task sends them lives there);
    else the stage fails now, saying how to fix it, instead of Dask waiting forever."""
    if resources.client is None:
        return
    lacking = workers_lacking(resources.client, package)
    if lacking:
        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        raise StageError(stage, f"the Dask workers of profile '{resources.profile}' cannot import the project's "
                                f"package '{package}' ({shown}): the functions the task sends them live "
                                f"there. Install the project where the workers run (pip install -e . in "
                                f"their environment, or start them with PYTHONPATH={root}), "
                                "or run the stage on a profile conveyor starts")


def restart(resources: Resources, log: logging.Logger, when: str, others: list[str]) -> None:
    """Restart the workers of a cluster conveyor started, unless ``others`` (stages) use it now:
    a failed or timed-out attempt may leave them blocked (a collective waiting for a dead peer,
    a long C call) or broken (xgboost's collective after a peer died), and a retry on them
    would fail or hang the same way. A cluster given by ``address:`` is never restarted."""
    if resources.client is None or resources.external:
        return
    if others:
        log.warning("%s: the workers of profile '%s' were not restarted: %s use them",
                    when, resources.profile, ", ".join(others))
        return
    try:
        with undo_nanny_environ():  # the nannies set their variables on this process again as they respawn
            resources.client.restart(timeout=120)
        log.warning("%s: restarted the workers of profile '%s' (what the stage left there is stopped)",
                    when, resources.profile)
    except Exception as exc:  # noqa: BLE001 - the stage's own error is the one to report
        log.warning("%s: restarting the workers of profile '%s' failed: %s", when, resources.profile, exc)


def died(exc: BaseException, resources: Resources) -> str:
    """Why a stage failed when Dask gave up on a task whose workers kept dying (KilledWorker)."""
    args: tuple[Any, ...] = exc.args
    task = f" {args[0]!r}" if args else ""
    tried = f" on {args[2] + 1} workers in turn" if len(args) > 2 and isinstance(args[2], int) else ""
    what = f"Dask workers of profile '{resources.profile}' died running its task{task}{tried} (KilledWorker)"
    if resources.memory_limit is not None:
        return (f"{what}; each worker may use {resources.memory_limit} (memory_limit), and a worker past 95% of "
                "it is killed: raise memory_limit or make the partitions smaller")
    return f"{what}; the workers' logs say why (memory, a crash in native code)"
