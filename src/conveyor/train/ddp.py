"""torch DistributedDataParallel on Dask workers: one rank per worker of the stage's cluster.

:func:`run_ddp` runs a project's training function once per worker, each call inside a
torch process group, and returns their results in rank order::

    def train_rank(rank: Rank, job: MyJob) -> MyResult:     # in the project's task package
        device = rank.device()
        model = DistributedDataParallel(build(job).to(device), device_ids=[0] if rank.gpu else None)
        for epoch in ...:
            rank.check()        # before every step: stops when another rank failed or the stage was interrupted
            ...
            rank.advance()      # the stage's progress bar, from rank 0
        return MyResult(...)

    results = run_ddp(ctx.client, train_rank, job, gpu=bool(ctx.devices), progress=ctx.progress)

- Rendezvous from the scheduler's view: rank = index of the worker's address in the sorted
  list, world size = number of workers, master = rank 0's host and a port picked free on
  rank 0's worker (a port taken in between fails the rendezvous after ``timeout_s``).
  ``gloo`` on CPU, ``nccl`` when the profile has GPUs: dask-cuda lists each worker's own
  GPU first in its ``CUDA_VISIBLE_DEVICES``, so every rank uses ``cuda:0``. One collective
  job per cluster at a time (:func:`conveyor.train.collective.collective_job`): a worker
  process holds one default process group, and gang-scheduled jobs can deadlock.
- Each rank runs with one torch thread (one core per worker), deterministic kernels and
  a forked RNG (:func:`conveyor.train.seed.deterministic_torch`): seed it in ``train``.
- Failure: a rank that raises keeps its error as text only, collects the DDP module and
  destroys its group, which closes its sockets, so peers blocked in a collective fail at
  once instead of at the timeout (gloo does not notice a peer whose sockets stay open).
  The ranks still running are asked to stop (a flag set by ``client.run`` that
  :meth:`Rank.check` reads; NCCL groups are aborted), all are awaited, and
  :class:`RankFailedError` names the rank that failed first. Ctrl-C and timeouts too.

The training function travels to the workers by reference: its module must be importable
there (a LocalCluster started by conveyor inherits the project root on ``sys.path``; an
existing cluster's workers need the project installed or on ``PYTHONPATH``), and every
worker must see the files it reads and writes (one machine, or a shared filesystem).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from conveyor.train.collective import collective_job, ranked_workers, worker_host
from conveyor.train.seed import deterministic_torch

if TYPE_CHECKING:
    import torch
    from distributed import Client, Future

    from conveyor.run.context import StageProgress

J = TypeVar("J")
R = TypeVar("R")

_STOP_GRACE_S = 60.0  # how long stopped ranks get to end before the task gives up on them


@dataclass
class DdpError(RuntimeError):
    """A DDP run could not start, or its ranks disagree."""

    reason: str

    def __str__(self) -> str:
        return f"DDP: {self.reason}"


@dataclass
class RankFailedError(DdpError):
    """A rank raised (the first to fail, when several did); the others were stopped."""

    rank: int
    world_size: int
    worker: str
    remote_traceback: str = ""

    def __str__(self) -> str:
        return f"DDP rank {self.rank} of {self.world_size} (worker {self.worker}) failed: {self.reason}"


@dataclass(frozen=True)
class Rank:
    """One rank of a DDP run, as its training function sees it."""

    run_id: str
    rank: int
    world_size: int
    init_method: str  # tcp://MASTER_ADDR:MASTER_PORT
    backend: str
    gpu: bool
    timeout_s: float
    progress_topic: str

    def device(self) -> torch.device:
        """``cuda:0`` (the worker's own GPU) on a GPU profile, else the CPU."""
        return _device(gpu=self.gpu)

    def check(self) -> None:
        """Raise if this rank was asked to stop (another rank failed, or the stage was interrupted)."""
        if self.run_id in _STOPPED:
            raise RuntimeError(f"rank {self.rank} stopped: another rank failed, or the stage was interrupted")

    def advance(self, amount: float = 1.0) -> None:
        """Advance the stage's progress bar (call it from one rank, usually rank 0)."""
        from distributed import get_worker

        get_worker().log_event(self.progress_topic, amount)


@dataclass(frozen=True)
class _Call(Generic[J, R]):
    """One rank's part of a run, as sent to its worker."""

    rank: Rank
    train: Callable[[Rank, J], R]
    job: J


def backend(*, gpu: bool) -> str:
    """The collective backend: NCCL between GPUs, gloo on CPU."""
    return "nccl" if gpu else "gloo"


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """A checksum of weights: names, dtypes, shapes and bytes, on CPU, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in state.items():
        cpu = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{cpu.dtype}:{tuple(cpu.shape)}".encode())
        digest.update(cpu.numpy().tobytes())
    return digest.hexdigest()


def init_method(address: str, port: int) -> str:
    """``tcp://host:port`` for rank 0's worker address (IPv6 hosts in brackets)."""
    host = worker_host(address)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# --- the task's side -------------------------------------------------------------------------


def run_ddp(client: Client, train: Callable[[Rank, J], R], job: J, *, gpu: bool = False, timeout_s: float = 300.0,
            progress: StageProgress | None = None, log: logging.Logger | None = None) -> list[R]:
    """Run ``train(rank, job)`` on every worker of ``client``, one rank each; results in rank order.

    ``timeout_s`` bounds the rendezvous and every collective. ``progress`` advances when a
    rank calls :meth:`Rank.advance` (start it with its total first).
    """
    log = log or logging.getLogger(__name__)
    with collective_job(client):
        workers = ranked_workers(client)
        master = workers[0]
        port = client.run(_free_port, worker_host(master), workers=[master])[master]
        run_id = uuid.uuid4().hex[:12]
        ranks = [Rank(run_id, r, len(workers), init_method(master, port), backend(gpu=gpu), gpu, timeout_s,
                      f"conveyor-ddp-{run_id}") for r in range(len(workers))]
        log.info("DDP over %d ranks (%s, %s)", len(workers), ranks[0].backend, ranks[0].init_method)
        try:
            return _run_ranks(client, workers, [_Call(rank, train, job) for rank in ranks], progress)
        except RankFailedError as failure:
            log.error("DDP rank %d failed:\n%s", failure.rank, failure.remote_traceback or failure.reason)
            raise


def _run_ranks(client: Client, workers: list[str], calls: list[_Call[J, R]],
               progress: StageProgress | None) -> list[R]:
    """Run every rank on its worker; on the first failure (or an interrupt) stop the rest."""
    from distributed import as_completed

    run_id, topic = calls[0].rank.run_id, calls[0].rank.progress_topic
    if progress is not None:
        client.subscribe_topic(topic, lambda event: progress.advance(float(event[1])))
    futures: list[Future[R]] = [
        client.submit(run_rank, call, key=f"ddp-rank-{call.rank.rank}-{run_id}",
                      workers=[worker], allow_other_workers=False, pure=False, retries=0)
        for call, worker in zip(calls, workers, strict=True)
    ]
    try:
        for future in as_completed(futures, loop=client.loop):  # polls: Ctrl-C and stage timeouts land here
            if future.status == "error":
                break
    finally:
        _stop(client, futures, workers, run_id)
        if progress is not None:
            client.unsubscribe_topic(topic)
    failed = [(rank, future.exception()) for rank, future in enumerate(futures) if future.status == "error"]
    if failed:
        raise _first_failure(failed, workers)
    return [future.result() for future in futures]


def _stop(client: Client, futures: list[Future[Any]], workers: list[str], run_id: str) -> None:
    """Ask every rank still running to stop at its next step, and wait until all ended."""
    from distributed import as_completed

    running = [future for future in futures if not future.done()]
    if not running:
        return
    client.run(_stop_rank, run_id, workers=[workers[futures.index(f)] for f in running], on_error="ignore")
    try:
        for _ in as_completed(running, loop=client.loop, timeout=_STOP_GRACE_S):
            pass
    except TimeoutError:
        logging.getLogger(__name__).warning(
            "DDP ranks %s still run %gs after the stop; they end at their collective timeout",
            [futures.index(f) for f in running], _STOP_GRACE_S,
        )
        client.cancel(futures)


def _first_failure(failed: list[tuple[int, BaseException]], workers: list[str]) -> RankFailedError:
    """The root cause: the rank that failed first (the others lost a peer, or were stopped).

    A failure outside a rank's training (its worker died) counts as the first.
    """

    def when(item: tuple[int, BaseException]) -> tuple[float, int]:
        rank, error = item
        return (error.failed_at if isinstance(error, RankError) else float("-inf"), rank)

    rank, error = min(failed, key=when)
    reason = str(error) if isinstance(error, RankError) else f"{type(error).__name__}: {error}"
    trace = error.traceback_text if isinstance(error, RankError) else ""
    failure = RankFailedError(reason, rank=rank, world_size=len(workers), worker=workers[rank], remote_traceback=trace)
    failure.__cause__ = error
    return failure


# --- the workers' side ----------------------------------------------------------------------


class RankError(RuntimeError):
    """A rank's failure as text and a time: it pickles, and it holds no frame.

    Holding no frame matters: a live traceback keeps the DDP module, and through it the
    process group and its sockets, alive past ``destroy_process_group``.
    """

    def __init__(self, message: str, traceback_text: str, failed_at: float) -> None:
        super().__init__(message, traceback_text, failed_at)
        self.message, self.traceback_text, self.failed_at = message, traceback_text, failed_at

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:  # what Dask logs: the message, not the whole traceback
        return f"RankError({self.message!r})"

    @classmethod
    def from_exception(cls, exc: BaseException) -> RankError:
        return cls(f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)), time.time())


_STOPPED: set[str] = set()  # run ids the task asked to stop
_ACTIVE: dict[str, str] = {}  # run id -> backend of the process group this worker runs
_GROUP_LOCK = threading.Lock()  # a group is not aborted while it is being destroyed


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _stop_rank(run_id: str) -> None:
    """Ask this worker's rank of ``run_id`` to stop at its next step (runs on the event loop).

    Under NCCL the rank's thread may wait on a GPU stream for a peer that is gone and never
    reach its next step: its group is aborted, as torch's NCCL watchdog would at the timeout.
    """
    _STOPPED.add(run_id)
    with _GROUP_LOCK:
        if _ACTIVE.get(run_id) == "nccl":
            _abort_world()


def _abort_world() -> None:
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None:
        world.abort()


def run_rank(call: _Call[J, R]) -> R:
    """One rank, start to end, on a Dask worker: one torch thread, its process group torn down."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per worker; torch would take them all
    try:
        outcome = _run_in_group(call)
    finally:
        torch.set_num_threads(threads)
        _STOPPED.discard(call.rank.run_id)
    if isinstance(outcome, RankError):
        raise outcome
    return outcome


def _run_in_group(call: _Call[J, R]) -> R | RankError:
    """Train inside the process group; a failure comes back as a :class:`RankError`, made
    (and the DDP module's reference cycles collected) before the group is destroyed."""
    with _process_group(call.rank):
        try:
            with deterministic_torch(warn_only=call.rank.gpu):
                return call.train(call.rank, call.job)
        except Exception as exc:  # noqa: BLE001 -- re-raised by run_rank, as text
            failure = RankError.from_exception(exc)
        gc.collect()
        if call.rank.backend == "nccl":
            with _GROUP_LOCK:
                _abort_world()  # drop in-flight NCCL collectives rather than wait on them at destroy
    return failure


@contextmanager
def _process_group(rank: Rank) -> Iterator[None]:
    from datetime import timedelta

    import torch._dynamo  # noqa: F401  # DDP's constructor imports it; imported while a group
    import torch.distributed as dist  # lives, it pins that group for good (torch 2.13)

    if dist.is_initialized():
        raise RuntimeError("this worker already runs a torch process group (another DDP run?)")
    if rank.gpu:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        _device(gpu=True)  # NCCL binds the current device when the group starts
    dist.init_process_group(rank.backend, init_method=rank.init_method, rank=rank.rank, world_size=rank.world_size,
                            timeout=timedelta(seconds=rank.timeout_s))
    _ACTIVE[rank.run_id] = rank.backend
    try:
        yield
    finally:
        with _GROUP_LOCK:
            del _ACTIVE[rank.run_id]
            dist.destroy_process_group()


def _device(*, gpu: bool) -> torch.device:
    import torch

    if not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("the profile has GPUs but this worker sees none (CUDA_VISIBLE_DEVICES?)")
    torch.cuda.set_device(0)  # dask-cuda lists the worker's own GPU first
    return torch.device("cuda", 0)
