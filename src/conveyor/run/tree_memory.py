"""A ``cmd`` stage on a Dask worker, held to the worker's ``memory_limit``.

The nanny bounds a worker by the resident memory of the worker's own process, measured every
100 ms; a command runs in child processes of the worker (its guard, the shell and what they
start), which that measure never sees, so a command could use many times the limit. The code
that runs the command on the worker measures the command's process tree the same way (the
resident memory of its processes, summed) and kills the whole group past the same fraction
(``distributed.worker.memory.terminate``, 95 %) of the same ``memory_limit``.

Measured rather than enforced by the kernel: ``RLIMIT_AS`` bounds address space, not memory,
and numeric libraries reserve far more than they touch (CUDA maps a GPU's whole address range,
OpenBLAS and jemalloc reserve per-thread arenas), so commands well within their memory would
fail to start; Linux ignores ``RLIMIT_RSS``; a cgroup needs a delegated cgroup tree, which a
worker someone else started rarely has. Like the nanny's, a measure can miss a burst shorter
than its interval; and like ``ps``, it counts pages that forked processes share once per process,
so a command that forks workers sharing much memory is stopped earlier than it needs to be.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from conveyor.errors import StageError
from conveyor.run.guard import descendants


@dataclass(frozen=True)
class MemoryBudget:
    """What a command on a worker may hold: past ``limit * fraction`` bytes it is killed."""

    limit: int  # the worker's memory_limit, in bytes
    fraction: float  # distributed.worker.memory.terminate: where the nanny kills its worker

    @property
    def threshold(self) -> int:
        return int(self.limit * self.fraction)


def worker_budget(worker: Any) -> MemoryBudget | None:
    """The budget of a command on ``worker`` (a distributed Worker): what the nanny allows the
    worker; None where the worker has no limit or Dask's config turns termination off."""
    import dask.config

    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    fraction = dask.config.get("distributed.worker.memory.terminate", default=False)
    if not limit or fraction is False or fraction is None:
        return None
    return MemoryBudget(int(limit), float(fraction))


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (0 once it is gone)."""
    if os.path.isdir("/proc"):
        return sum(_rss(p) for p in [pid, *descendants(pid)])
    return _tree_rss_psutil(pid)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # ended since listed: holds nothing now
        return 0


def _tree_rss_psutil(pid: int) -> int:
    import psutil  # distributed's own dependency: present wherever a worker runs

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended since listed: holds nothing now
            continue
    return total


class CommandOverMemory(StageError):
    """A command on a Dask worker went past its worker's memory budget; its process group was killed."""

    def __init__(self, stage: str, used: int, limit: int, fraction: float) -> None:
        super().__init__(stage, f"its command's processes used {used / 2**20:.0f} MiB on a Dask worker whose "
                                f"memory_limit is {limit / 2**20:.0f} MiB, past {fraction:.0%} of it: killed")
        self.used, self.limit, self.fraction = used, limit, fraction

    def __reduce__(self) -> tuple[Any, ...]:  # pickles through Dask with its own arguments
        return (type(self), (self.stage, self.used, self.limit, self.fraction))
