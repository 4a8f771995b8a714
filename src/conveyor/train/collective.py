"""Jobs whose tasks wait on each other (xgboost.dask, torch DDP): one at a time, ranks in a fixed order."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client

COLLECTIVE_LOCK = "conveyor-collective"


class CollectiveError(RuntimeError):
    """The cluster cannot run a collective job (no workers, or workers sharing a process)."""


@contextmanager
def collective_job(client: Client) -> Iterator[None]:
    """Hold the cluster's lock for a job whose tasks wait on each other (xgboost.dask, DDP).

    Each such job runs one task per worker, and each task blocks until all of them run.
    Two jobs at once on workers with one thread each can deadlock: worker A runs job 1's
    task, worker B job 2's, and each waits for a thread the other holds. The lock lives
    on the scheduler, so it also serialises jobs of other runs sharing the cluster.
    """
    from distributed import Lock

    with Lock(COLLECTIVE_LOCK, scheduler_rpc=client.scheduler, loop=client.loop):
        yield


def ranked_workers(client: Client, *, one_process_each: bool = True) -> list[str]:
    """The workers' addresses in rank order (sorted); with ``one_process_each``, each must be its own process."""
    workers = sorted(within_hold(client.scheduler_info(n_workers=-1)["workers"]))
    if not workers:
        raise CollectiveError("the cluster has no workers")
    if one_process_each:
        processes = set(client.run(_process_id).values())
        if len(processes) < len(workers):
            raise CollectiveError(f"{len(workers)} workers share {len(processes)} process(es); this job needs one "
                                  "process per worker (a Dask profile with processes: true)")
    return workers


def within_hold(workers: Iterable[str]) -> list[str]:
    """``workers``, less those the current stage does not hold when it holds some for its
    ``resources:`` (:mod:`conveyor.run.held`): a job then runs on exactly the workers held."""
    from conveyor.run.held import held_workers

    held = held_workers()
    return [w for w in workers if held is None or w in held]


def worker_host(address: str) -> str:
    """The host of a worker address, whatever its protocol (tcp, tls, ucx...)."""
    from distributed.comm.addressing import parse_address, parse_host_port

    host, _ = parse_host_port(parse_address(address)[1])
    return str(host)


def _process_id() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()
