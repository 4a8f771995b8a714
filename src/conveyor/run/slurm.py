"""Dask workers as Slurm jobs (dask-jobqueue): the scheduler runs in conveyor's process, each
job runs Dask workers. dask_jobqueue is imported only here, on use.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from conveyor.errors import ProfileError
from conveyor.spec.profiles import SlurmProfile

_IMPORTING = threading.Lock()


def _slurm_cluster_class() -> Any:
    """dask_jobqueue's SLURMCluster, imported without its side effect on signals.

    ``dask_jobqueue.runner`` sets SIGINT to ``sys.exit`` when imported: from the main thread
    that would replace conveyor's Ctrl-C handling (the run would exit without its summary), and
    from a profile's starting thread the import fails ("signal only works in main thread").
    Only that module's call is skipped; every other caller of ``signal.signal`` is served.
    """
    real = signal.signal

    def skip_jobqueue_runner(signum: Any, handler: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") == "dask_jobqueue.runner":
            return signal.getsignal(signum)
        return real(signum, handler)

    with _IMPORTING:
        signal.signal = skip_jobqueue_runner  # type: ignore[assignment]
        try:
            from dask_jobqueue.slurm import SLURMCluster
        finally:
            signal.signal = real
    return SLURMCluster


def slurm_cluster(name: str, profile: SlurmProfile) -> Any:
    """A dask-jobqueue SLURMCluster for the profile (its scheduler runs here; no job submitted yet)."""
    try:
        cluster_class = _slurm_cluster_class()
    except ImportError as exc:
        raise ProfileError(f"profile '{name}' needs dask-jobqueue: pip install 'conveyor[slurm]' ({exc})") from exc
    options: dict[str, Any] = {
        "queue": profile.queue, "account": profile.account, "interface": profile.interface,
        "cores": profile.cores, "memory": profile.memory, "walltime": profile.walltime,
        "processes": profile.processes, "job_extra_directives": list(profile.job_extra),
        "job_name": f"conveyor-{name}",
    }
    return cluster_class(**{k: v for k, v in options.items() if v is not None})
