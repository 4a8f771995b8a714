"""memory-cap's Dask side, in a process of its own: the task once on a 2-worker LocalCluster whose
workers have ``memory_limit`` = the cap, stopped at the first restart of a worker or at the deadline."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.compute.memory_cap import PREPROCESS, SAMPLE_S, WORKERS, XGBOOST

if TYPE_CHECKING:
    from distributed import Client


class _Watch(logging.Handler):
    """Ends the work at the first sign that it did not complete as measured: a warning of the
    nannies (in this process: a worker restarted, or killed above its memory budget) or the
    deadline. It records why and interrupts the main thread (SIGINT to this process: a
    KeyboardInterrupt where the client waits on the cluster), which then closes the cluster."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        self.armed = False
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        self.stop(f"a worker was restarted: {record.name}: {record.getMessage()}")

    def stop(self, reason: str) -> None:
        with self._lock:
            if not self.armed:
                return
            self.reasons.append(reason)
            if len(self.reasons) == 1:
                os.kill(os.getpid(), signal.SIGINT)

    def disarm(self) -> None:
        with self._lock:
            self.armed = False


def _prepare_on(client: Client, src: Path, out: Path, report: dict[str, Any]) -> None:
    from benchmarks.compute.preprocess_pandas import _Messages
    from benchmarks.compute.preprocess_workers import preprocess_context, warm_imports
    from benchmarks.stages import current
    from tasks.preprocess import prepare

    client.run(warm_imports)
    messages = _Messages()
    logger = logging.getLogger(f"benchmarks.{PREPROCESS}")  # the ctx.log of benchmarks.stages.context
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    report["messages"] = messages.lines
    ctx = preprocess_context(out, src, out / "processed", client, WORKERS)
    began = time.perf_counter()
    with current(client):
        prepare(ctx)
    report["seconds"] = time.perf_counter() - began


def _train_on(client: Client, src: Path, report: dict[str, Any]) -> None:
    import dask.dataframe as dd

    from benchmarks.compute.xgboost_dask import LABEL, booster_params
    from benchmarks.stages import current
    from conveyor.train.xgb import train_xgboost

    client.run(lambda: __import__("xgboost"))  # imported in the workers before the clock starts, as xgboost-dask
    params, rounds, patience = booster_params(None)
    split = {name: dd.read_parquet(str(src / name)) for name in ("train", "valid")}
    features = [c for c in split["train"].columns if c != LABEL]
    began = time.perf_counter()
    with current(client):
        trained = train_xgboost(client, params, split["train"], valid=split["valid"], label=LABEL, features=features,
                                num_boost_round=rounds, early_stopping_rounds=patience)
    report["seconds"] = time.perf_counter() - began
    losses = trained.history["valid"]["logloss"]
    report |= {"best_iteration": trained.best_iteration, "best_logloss": float(losses[trained.best_iteration]),
               "rounds": trained.rounds, "n_workers": trained.n_workers}


def side_main(argv: list[str]) -> int:
    """``preprocess|xgboost CAP_BYTES DEADLINE_S SRC OUT``: the task once on a 2-worker LocalCluster
    whose workers have ``memory_limit=CAP_BYTES``; print one JSON line.

    preprocess reads raw parts from SRC and writes ``OUT/processed``; xgboost trains on the
    splits in SRC. Spilled data goes to ``OUT/dask``. ``completed``: the work returned, no
    worker was restarted or replaced, within the deadline; ``reason`` otherwise; ``seconds``:
    the work alone; ``start``: the cluster up, both workers registered.
    """
    task, cap, deadline, src, out = argv[0], int(argv[1]), float(argv[2]), Path(argv[3]), Path(argv[4])
    if task not in (PREPROCESS, XGBOOST):
        raise SystemExit(f"memory_cap: unknown task {task!r}, expected {PREPROCESS} or {XGBOOST}")
    began = time.perf_counter()
    import dask
    from distributed import Client, LocalCluster

    dask.config.set({"distributed.worker.memory.monitor-interval": f"{round(SAMPLE_S * 1000)}ms"})
    watch = _Watch()
    logging.getLogger("distributed.nanny").addHandler(watch)
    report: dict[str, Any] = {"task": task, "completed": False, "reason": ""}
    timer = threading.Timer(deadline, lambda: watch.stop(f"still running at the deadline of {deadline:.0f} s"))
    timer.daemon = True
    try:
        with ExitStack() as stack:
            cluster = stack.enter_context(LocalCluster(
                n_workers=WORKERS, threads_per_worker=1, processes=True, memory_limit=cap, host="127.0.0.1",
                dashboard_address=":0", scheduler_kwargs={"dashboard": False}, silence_logs=logging.WARNING,
                local_directory=str(out / "dask")))
            client: Client = stack.enter_context(Client(cluster, set_as_default=False))
            client.wait_for_workers(WORKERS, timeout=120)
            pids = client.run(os.getpid)
            report["start"] = time.perf_counter() - began
            watch.armed = True
            timer.start()
            if task == PREPROCESS:
                _prepare_on(client, src, out, report)
            else:
                _train_on(client, src, report)
            watch.disarm()
            timer.cancel()
            after = client.run(os.getpid)
            replaced = sorted(set(after.values()) ^ set(pids.values()))
            report["workers_pids"] = sorted(after.values())
            if replaced:
                watch.reasons.append(f"worker processes replaced while it ran (pids {replaced})")
            report["completed"] = not watch.reasons
            closing = time.perf_counter()
        report["close"] = time.perf_counter() - closing
    except KeyboardInterrupt:
        report["interrupted"] = True
    except Exception as exc:  # noqa: BLE001 - an error of the task on the capped cluster is an outcome, reported
        watch.reasons.append(f"error: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        watch.disarm()
        timer.cancel()
    report["reason"] = "; ".join(watch.reasons)
    print(json.dumps(report), flush=True)
    return 0
