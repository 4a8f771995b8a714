"""The runner's environment, kept from what Dask's nannies write into it.

A Dask Nanny sets the variables of ``distributed.nanny.pre-spawn-environ`` (by default
``MALLOC_TRIM_THRESHOLD_=65536``, ``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``,
``OPENBLAS_NUM_THREADS=1``; also ``PYTHONHASHSEED`` and ``__DASK_PARENT_PID``) on ``os.environ``
of the process the nanny runs in, each time it spawns a worker process: distributed/nanny.py,
``WorkerProcess.start``, ``os.environ.update(self.pre_spawn_env)``; Dask's docs say so, "even if
this means poisoning the process running the Nanny". The nannies of a LocalCluster (and of
dask-cuda's LocalCUDACluster) that conveyor starts run in the runner's own process, so without
care every command stage started afterwards would run with OpenMP, MKL and OpenBLAS held to one
thread and glibc's trim threshold at 64 KiB (a user's ``python train.py`` single-threaded,
without a word), and so would a library imported in the runner later (torch reads
``OMP_NUM_THREADS`` when it starts its thread pool).

The workers keep Dask's settings; nothing else gets them. :func:`undo_nanny_environ` wraps the
start of a local cluster and puts ``os.environ`` back as it was; as a nanny sets them again when
it restarts a worker, :func:`user_environ` gives subprocesses the environment without them.
What the workers get is Dask's, with a profile's ``worker_env`` over it (:func:`worker_environ`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_ALSO_SET = ("PYTHONHASHSEED", "__DASK_PARENT_PID")  # what a nanny sets besides its pre-spawn-environ
_LOCK = threading.Lock()
# a variable a nanny of this process changed -> (the value it had before, None: unset; the nanny's value)
_NANNY_SET: dict[str, tuple[str | None, str]] = {}


def user_environ() -> dict[str, str]:
    """``os.environ`` as the user gave it: the environment for a process conveyor starts.

    A variable that still holds the value a nanny of this process wrote (at a cluster's start,
    or again when it restarted a worker; see the module's docstring) gets back the value it had
    before, or is left out if it had none; a value set by the user, in the shell before the run
    (``OMP_NUM_THREADS=4``) or in the runner since, is kept as it is. In a process that started
    no nanny (a Dask worker, whose environment Dask means to have), this is ``os.environ``.
    """
    env = dict(os.environ)
    with _LOCK:
        for name, (before, nannys) in _NANNY_SET.items():
            if env.get(name) != nannys:
                continue
            if before is None:
                del env[name]
            else:
                env[name] = before
    return env


@contextmanager
def undo_nanny_environ() -> Iterator[None]:
    """Around the start of a cluster whose nannies run in this process: ``os.environ`` is as it
    was before once the block ends (the workers, spawned in it, keep Dask's variables).

    Restored: the variables of ``distributed.nanny.pre-spawn-environ``, ``PYTHONHASHSEED`` and
    ``__DASK_PARENT_PID``; each is remembered for :func:`user_environ`. Starts are one at a
    time (``profiles._STARTING``); a change another thread makes to one of them meanwhile is
    undone too.
    """
    import dask.config

    names = {*(dask.config.get("distributed.nanny.pre-spawn-environ", default=None) or {}), *_ALSO_SET}
    before = user_environ()  # a restarted worker of an earlier cluster may have written them again
    try:
        yield
    finally:
        after = dict(os.environ)
        with _LOCK:
            for name in names:
                old, new = before.get(name), after.get(name)
                if old == new:
                    continue
                if new is not None:
                    _NANNY_SET[name] = (old, new)
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old


@contextmanager
def worker_environ(env: Mapping[str, str | int | None] | None) -> Iterator[None]:
    """Dask's ``distributed.nanny.pre-spawn-environ`` with a profile's ``worker_env`` over it, for
    the nannies created in the block: they set it before a worker process starts, which is when
    glibc's malloc and OpenMP read it (``LocalCluster(env=...)`` comes too late for those).
    A None removes one of Dask's, e.g. ``MALLOC_TRIM_THRESHOLD_``."""
    if not env:
        yield
        return
    import dask.config

    merged = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default=None) or {})
    for name, value in env.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": merged}):
        yield
