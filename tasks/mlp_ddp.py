"""torch DistributedDataParallel on Dask workers: one rank per worker of the stage's cluster.

The task (in the runner's process) plans, one long-running Dask task per worker trains:

- Rendezvous from the scheduler's view: rank = index of the worker's address in the sorted
  list, world size = number of workers, master = rank 0's host and a port picked free on
  rank 0's worker (``client.run``; a port taken in between fails the rendezvous after
  ``collective_timeout_s``). ``gloo`` on CPU, ``nccl`` when the profile has GPUs: dask-cuda
  lists each worker's own GPU first in its ``CUDA_VISIBLE_DEVICES``, so every rank uses
  ``cuda:0``. One collective job per cluster at a time (:func:`tasks.train.collective_job`):
  a worker process holds one default process group, and gang-scheduled jobs can deadlock.
- Data: every rank reads the whole (small) train split and a ``DistributedSampler`` deals
  each rank a disjoint share of one seeded permutation per epoch. Why not each rank its own
  parquet parts: the sampler pads the ranks to equal shares, so all take the same number of
  steps (DDP all-reduces in every backward; a rank with a step more waits forever), and the
  shuffle stays global as in the in-process fit. The price: a rank holds the whole split.
- Same seed on every rank; early stopping on the valid loss all-reduced over the ranks, so
  all stop at the same epoch. Synchronous data parallel: every rank ends with the same
  weights; each returns their SHA-256 and the task fails unless they, and the file rank 0
  wrote, agree.
- Failure: a rank that raises keeps its error as text only, collects the DDP module and
  destroys its group, which closes its sockets, so peers blocked in a collective fail at
  once instead of at the timeout (gloo does not notice a peer whose sockets stay open).
  The task asks the ranks still running to stop (a flag set by ``client.run``, checked
  before every step; NCCL groups are aborted), waits for all, and raises
  :class:`RankFailedError` for the rank that failed first. Ctrl-C and timeouts too.

Limitation: ranks read ``data/processed`` and rank 0 writes the model at the paths the task
passes, so every worker must see the project's filesystem: true on one machine
(LocalCluster, LocalCUDACluster); a multi-machine cluster needs a shared filesystem (the
check of the written file fails the stage otherwise). Workers must import ``tasks``.
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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks import models
from tasks.train import FitResult, MlpParams, collective_job, deterministic_torch, snapshot, tensors

if TYPE_CHECKING:
    import torch
    from distributed import Client, Future

    from conveyor.run.context import StageProgress

_STOP_GRACE_S = 60.0  # how long stopped ranks get to end before the task gives up on them


@dataclass
class DdpError(RuntimeError):
    """A DDP run could not start, or its ranks disagree on the weights."""

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
class DdpJob:
    """What to train: data, where rank 0 writes the model, params, seed, on GPUs or not."""

    processed: str
    out: str
    params: MlpParams
    seed: int
    gpu: bool = False


@dataclass(frozen=True)
class RankTask:
    """One rank's part of a run, as sent to its worker."""

    run_id: str
    rank: int
    world_size: int
    init_method: str  # tcp://MASTER_ADDR:MASTER_PORT
    backend: str
    job: DdpJob
    progress_topic: str


@dataclass(frozen=True)
class RankResult:
    """What a rank reports: its weights' checksum and the (all-reduced, so shared) losses."""

    rank: int
    device: str
    weights_sha256: str
    epochs: int
    best_epoch: int
    initial_valid_loss: float
    best_valid_loss: float


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


# --- the task's side -------------------------------------------------------------------------


def train_on_workers(
    client: Client, job: DdpJob, *, progress: StageProgress, log: logging.Logger
) -> list[RankResult]:
    """Train with one rank per worker; the ranks' results in rank order, checked to agree."""
    with collective_job(client):
        workers = ranked_workers(client)
        master = workers[0]
        port = client.run(_free_port, worker_host(master), workers=[master])[master]
        tasks = _rank_tasks(workers, init_method(master, port), job)
        log.info("mlp: DDP over %d ranks (%s, %s)", len(workers), tasks[0].backend, tasks[0].init_method)
        progress.start(job.params.max_epochs, unit="epochs", description=f"mlp DDP x{len(workers)}")
        try:
            results = _run_ranks(client, workers, tasks, progress)
        except RankFailedError as failure:
            log.error("DDP rank %d failed:\n%s", failure.rank, failure.remote_traceback or failure.reason)
            raise
    _check_agreement(results, Path(job.out))
    return results


def ranked_workers(client: Client) -> list[str]:
    """The workers' addresses in rank order; each must be its own process."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    processes = set(client.run(_process_id).values())
    if not workers:
        raise DdpError("the cluster has no workers")
    if len(processes) < len(workers):
        raise DdpError(
            f"{len(workers)} workers share {len(processes)} process(es); DDP needs one process per "
            "worker (a Dask profile with processes: true)"
        )
    return workers


def worker_host(address: str) -> str:
    """The host of a worker address, whatever its protocol (tcp, tls, ucx...)."""
    from distributed.comm.addressing import parse_address, parse_host_port

    host, _ = parse_host_port(parse_address(address)[1])
    return str(host)


def init_method(address: str, port: int) -> str:
    """``tcp://host:port`` for rank 0's worker address (IPv6 hosts in brackets)."""
    host = worker_host(address)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _rank_tasks(workers: list[str], method: str, job: DdpJob) -> list[RankTask]:
    run_id = uuid.uuid4().hex[:12]
    topic = f"conveyor-ddp-{run_id}"
    return [
        RankTask(run_id, rank, len(workers), method, backend(gpu=job.gpu), job, topic) for rank in range(len(workers))
    ]


def _run_ranks(
    client: Client, workers: list[str], tasks: list[RankTask], progress: StageProgress
) -> list[RankResult]:
    """Run every rank on its worker; on the first failure (or an interrupt) stop the rest."""
    from distributed import as_completed

    topic = tasks[0].progress_topic
    client.subscribe_topic(topic, lambda _event: progress.advance(1))
    futures = [
        client.submit(
            run_rank, task, key=f"ddp-rank-{task.rank}-{task.run_id}",
            workers=[worker], allow_other_workers=False, pure=False, retries=0,
        )
        for task, worker in zip(tasks, workers, strict=True)
    ]
    try:
        for future in as_completed(futures, loop=client.loop):  # polls: Ctrl-C and stage timeouts land here
            if future.status == "error":
                break
    finally:
        _stop(client, futures, workers, tasks[0].run_id)
        client.unsubscribe_topic(topic)
    failed = [(rank, future.exception()) for rank, future in enumerate(futures) if future.status == "error"]
    if failed:
        raise _first_failure(failed, workers)
    return [future.result() for future in futures]


def _stop(client: Client, futures: list[Future[RankResult]], workers: list[str], run_id: str) -> None:
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


def _check_agreement(results: list[RankResult], out: Path) -> None:
    sums = {result.rank: result.weights_sha256 for result in results}
    if len(set(sums.values())) != 1:
        listed = ", ".join(f"rank {rank}: {digest[:12]}" for rank, digest in sums.items())
        raise DdpError(f"ranks ended with different weights ({listed})")
    try:
        written = weights_sha256(models.load_mlp(out)[0].state_dict())
    except FileNotFoundError:
        raise DdpError(f"rank 0 wrote no model at {out}: do all workers see this filesystem?") from None
    if written != results[0].weights_sha256:
        raise DdpError(f"the model file {out} does not hold the weights the ranks agreed on")


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


def _process_id() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


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


def run_rank(task: RankTask) -> RankResult:
    """One rank, start to end, on a Dask worker: one torch thread, its process group torn down."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per worker; torch would take them all
    try:
        outcome = _run_in_group(task)
    finally:
        torch.set_num_threads(threads)
        _STOPPED.discard(task.run_id)
    if isinstance(outcome, RankError):
        raise outcome
    return outcome


def _run_in_group(task: RankTask) -> RankResult | RankError:
    """Train inside the process group; a failure comes back as a :class:`RankError`, made
    (and the DDP module's reference cycles collected) before the group is destroyed."""
    import torch

    with _process_group(task):
        try:
            with deterministic_torch(warn_only=task.job.gpu), torch.random.fork_rng(devices=[]):
                return _train_rank(task)
        except Exception as exc:  # noqa: BLE001 -- re-raised by run_rank, as text
            failure = RankError.from_exception(exc)
        gc.collect()
        if task.backend == "nccl":
            with _GROUP_LOCK:
                _abort_world()  # drop in-flight NCCL collectives rather than wait on them at destroy
    return failure


@contextmanager
def _process_group(task: RankTask) -> Iterator[None]:
    from datetime import timedelta

    import torch._dynamo  # noqa: F401  # DDP's constructor imports it; imported while a group
    import torch.distributed as dist  # lives, it pins that group for good (torch 2.13)

    if dist.is_initialized():
        raise RuntimeError("this worker already runs a torch process group (another DDP run?)")
    if task.job.gpu:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        _device(gpu=True)  # NCCL binds the current device when the group starts
    dist.init_process_group(
        task.backend,
        init_method=task.init_method,
        rank=task.rank,
        world_size=task.world_size,
        timeout=timedelta(seconds=task.job.params.collective_timeout_s),
    )
    _ACTIVE[task.run_id] = task.backend
    try:
        yield
    finally:
        with _GROUP_LOCK:
            del _ACTIVE[task.run_id]
            dist.destroy_process_group()


def _device(*, gpu: bool) -> torch.device:
    import torch

    if not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("the profile has GPUs but this worker sees none (CUDA_VISIBLE_DEVICES?)")
    torch.cuda.set_device(0)  # dask-cuda lists the worker's own GPU first
    return torch.device("cuda", 0)


@dataclass
class _Shard:
    """A rank's data on its device: all of train (the sampler picks), its rows of valid."""

    x: torch.Tensor
    y: torch.Tensor
    valid_x: torch.Tensor
    valid_y: torch.Tensor


def _train_rank(task: RankTask) -> RankResult:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    job, rank, world = task.job, task.rank, task.world_size
    device = _device(gpu=job.gpu)
    processed = Path(job.processed)
    train, valid = models.read_split(processed, "train"), models.read_split(processed, "valid")
    features = list(train.features.columns)
    sizes = [len(features), *job.params.hidden, 1]
    torch.manual_seed(job.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = models.build_mlp(sizes).to(device)
    wrapped = DistributedDataParallel(model, device_ids=[0] if job.gpu else None)
    (x, y), (valid_x, valid_y) = tensors(train), tensors(valid)
    shard = _Shard(x.to(device), y.to(device), valid_x[rank::world].to(device), valid_y[rank::world].to(device))
    fit = _fit(task, model, wrapped, shard)
    model.load_state_dict(fit.state)
    if rank == 0:
        models.save_mlp(Path(job.out), model, sizes, features)
    return RankResult(
        rank, str(device), weights_sha256(model.state_dict()),
        fit.epochs, fit.best_epoch, fit.initial_valid_loss, fit.best_valid_loss,
    )


def _fit(task: RankTask, model: torch.nn.Module, wrapped: torch.nn.Module, shard: _Shard) -> FitResult:
    """Adam over the sampler's share, until the global valid loss stalls for ``patience`` epochs."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    params = task.job.params
    sampler: DistributedSampler[int] = DistributedSampler(
        TensorDataset(shard.x, shard.y), num_replicas=task.world_size, rank=task.rank, seed=task.job.seed
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=params.learning_rate, weight_decay=params.weight_decay)
    initial = _global_valid_loss(model, shard)
    fit = FitResult(snapshot(model), 0, 0, initial, initial)
    for epoch in range(1, params.max_epochs + 1):
        sampler.set_epoch(epoch)
        _train_epoch(task, wrapped, optimizer, shard, list(sampler))
        loss = _global_valid_loss(model, shard)
        fit.epochs = epoch
        if task.rank == 0:
            _report_epoch(task.progress_topic, epoch)
        if loss < fit.best_valid_loss:
            fit.state, fit.best_epoch, fit.best_valid_loss = snapshot(model), epoch, loss
        elif epoch - fit.best_epoch >= params.patience:
            break
    return fit


def _train_epoch(
    task: RankTask, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: _Shard, rows: list[int]
) -> None:
    """Steps over this rank's rows: the same number on every rank (the sampler pads).

    ``batch_size`` is the global batch, split over the ranks; DDP averages the gradients.
    """
    import torch

    loss_fn = torch.nn.BCEWithLogitsLoss()
    per_rank = max(1, task.job.params.batch_size // task.world_size)
    wrapped.train()
    for batch in torch.split(torch.tensor(rows, device=shard.x.device), per_rank):
        _before_step(task)
        optimizer.zero_grad()
        loss_fn(wrapped(shard.x[batch]).squeeze(1), shard.y[batch]).backward()  # all-reduces the gradients
        optimizer.step()


def _before_step(task: RankTask) -> None:
    if task.run_id in _STOPPED:
        raise RuntimeError(f"rank {task.rank} stopped: another rank failed, or the stage was interrupted")
    if task.job.params.fail_on_rank == task.rank:
        raise RuntimeError(f"rank {task.rank} failing on purpose (train.mlp.fail_on_rank: {task.rank})")


def _global_valid_loss(model: torch.nn.Module, shard: _Shard) -> float:
    """Mean BCE over all of valid: per-rank sums and counts, all-reduced (same value on every rank)."""
    import torch
    import torch.distributed as dist

    model.eval()
    with torch.no_grad():
        total = torch.nn.functional.binary_cross_entropy_with_logits(
            model(shard.valid_x).squeeze(1), shard.valid_y, reduction="sum"
        )
    count = torch.tensor(float(len(shard.valid_y)), dtype=torch.float64, device=total.device)
    sums = torch.stack([total.double(), count])
    dist.all_reduce(sums)
    return float(sums[0] / sums[1])


def _report_epoch(topic: str, epoch: int) -> None:
    """Tell the task an epoch ended (it advances the stage's progress bar)."""
    from distributed import get_worker

    get_worker().log_event(topic, {"epoch": epoch})
