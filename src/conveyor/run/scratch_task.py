"""A task stage run whole on one Dask worker that does not see the project's disk.

On a shared disk a task runs in the runner and sends the workers what it computes. Without one
its paths mean nothing to them, so the task itself goes to a worker (its code pickled by value,
:mod:`conveyor.run.shipping`), in a scratch directory holding its deps
(:mod:`conveyor.run.unshared`); ``ctx.client`` there is the worker's own client to the same
cluster (the task's thread leaves the worker's pool while it waits on it). Its log lines travel
back as Dask events, as a command's do (:mod:`conveyor.run.commands`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.run.commands import Sink, _Batch, followed
from conveyor.run.isolated import Payload

if TYPE_CHECKING:
    from distributed import Client

    from conveyor.run.context import StageContext
    from conveyor.run.unshared import Shipment

def run_task_on_worker(client: Client, fn: Callable[[StageContext], None], payload: Payload, shipment: Shipment,
                       sink: Sink, workers: Sequence[str] | None = None) -> dict[str, str]:
    """Run the task ``fn`` on one worker (of ``workers``, when given) in a scratch directory; its
    log lines come to ``sink``; returns its outs' hashes in the remote."""
    topic = f"conveyor-task-{uuid.uuid4().hex[:12]}"
    outs: dict[str, str] = followed(
        client, topic, sink, shipment,
        lambda: client.submit(task_on_worker, fn, payload, shipment, topic, pure=False,
                              key=f"conveyor-task-{payload.stage}-{topic[-12:]}", retries=0,
                              workers=list(workers) if workers else None, allow_other_workers=False),
        stop=lambda future: future.cancel())
    return outs


def task_on_worker(fn: Callable[[StageContext], None], payload: Payload, shipment: Shipment,
                   topic: str) -> dict[str, str]:
    """The Dask task: the stage's task in a scratch directory; returns its outs' hashes."""
    from distributed import get_worker

    from conveyor.run.unshared import CHECKPOINT, Released, run_in_scratch, stopped_when_released
    from conveyor.run.watchdog import raise_in

    worker = get_worker()
    batch = _Batch(lambda lines: worker.log_event(topic, lines))
    handler = _LinesHandler(batch)
    logger = logging.getLogger(f"conveyor.task.{payload.stage}.{topic}")  # this call's only
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    ident = threading.get_ident()
    try:
        with stopped_when_released(lambda: raise_in(ident, Released)):
            _, outs = run_in_scratch(shipment, lambda scratch: _call(fn, payload, shipment, scratch, logger),
                                     lambda line: batch.add("err", line),
                                     stored=lambda value: batch.add(CHECKPOINT, value))
        return outs
    finally:
        logger.removeHandler(handler)
        batch.close()
        worker.log_event(topic, None)


def _call(fn: Callable[[StageContext], None], payload: Payload, shipment: Shipment, scratch: Path,
          logger: logging.Logger) -> None:
    """``fn(ctx)`` with the paths of the scratch directory and the worker's client."""
    from distributed import worker_client

    from conveyor.run.checkpoints import Checkpoint, using
    from conveyor.run.context import StageContext, current_client
    from conveyor.run.unshared import moved

    def where(paths: dict[str, str] | Any) -> dict[str, Path]:
        return {name: Path(moved(path, shipment, scratch)) for name, path in paths.items()}

    rel = shipment.checkpoint_rel()
    folder = scratch / (rel if rel is not None else ".conveyor-checkpoint")  # made by run_in_scratch, or here
    checkpoint = Checkpoint(folder, shipment.checkpoint.run_id if shipment.checkpoint is not None else "")
    with worker_client() as client, current_client(client), using(checkpoint):
        ctx = StageContext(
            stage=payload.stage, params=payload.params, root=scratch, log=logger, deps=where(payload.deps),
            outs=where(payload.outs), metrics=where(payload.metrics), names=payload.names, item=payload.item,
            needed=payload.needed, client=client, n_workers=len(client.scheduler_info(n_workers=-1)["workers"]),
            checkpoint_dir=folder,
        )
        for path in [*ctx.outs.values(), *ctx.metrics.values()]:
            path.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(parents=True, exist_ok=True)  # there, as in the runner; its saves go back through the remote
        fn(ctx)


class _LinesHandler(logging.Handler):
    """A task's log records as lines of its stage's log, sent in batches."""

    def __init__(self, batch: _Batch) -> None:
        super().__init__()
        self.batch = batch
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.batch.add("err", self.format(record))
