"""torch DDP on Dask workers (conveyor.train.ddp): one rank per worker of the session's 2-process
LocalCluster (conftest.client), gloo on CPU, on the data of the shared reference chain.

    task (this process) --client.submit(workers=[w])--> rank 0 on worker A --gloo-- rank 1 on worker B
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from distributed import Client, LocalCluster
from stagebench import REPO, StageBench

from conveyor import StageContext, StageProgress
from conveyor.train import collective, ddp
from tasks import mlp, mlp_ddp, models, train

MLP_METRICS = ["epochs", "best_epoch", "initial_valid_loss", "best_valid_loss"]


@pytest.fixture
def data_bench(chain: StageBench, bench: StageBench) -> StageBench:
    """An empty project whose data/ is the reference chain's (preprocessed once per test run)."""
    (bench.root / "data").symlink_to(chain.root / "data", target_is_directory=True)
    return bench


def run_mlp(bench: StageBench, client: Client | None, **overrides: Any) -> StageContext:
    """The train_mlp stage on ``client`` (None: in-process), with train.mlp keys replaced."""
    return bench.run(
        train.mlp_model,
        params=["train.mlp", "seed"],
        deps=["data/processed"],
        outs=["models/mlp.pt"],
        metrics=["metrics/train_mlp.json"],
        client=client,
        overrides={"train.mlp": {**bench.params["train"]["mlp"], **overrides}},
    )


def job(bench: StageBench, **overrides: Any) -> mlp_ddp.DdpJob:
    params = mlp.MlpParams.from_params({**bench.params["train"]["mlp"], **overrides})
    out = bench.root / "models/mlp.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    return mlp_ddp.DdpJob(str(bench.root / "data/processed"), str(out), params, seed=int(bench.params["seed"]))


def test_every_rank_ends_with_the_same_weights_and_rank_0_saved_them(client: Client, data_bench: StageBench) -> None:
    progress = StageProgress()

    ranks = mlp_ddp.train(client, job(data_bench), gpu=False, progress=progress, log=logging.getLogger("tests.ddp"))

    assert [rank.rank for rank in ranks] == [0, 1]
    assert {rank.device for rank in ranks} == {"cpu"}
    assert ranks[0].weights_sha256 == ranks[1].weights_sha256  # synchronous data parallel
    assert len({(r.epochs, r.best_epoch, r.initial_valid_loss, r.best_valid_loss) for r in ranks}) == 1
    assert ranks[0].best_valid_loss < 0.25 * ranks[0].initial_valid_loss  # the loss went down
    saved, _ = models.load_mlp(data_bench.root / "models/mlp.pt")
    assert ddp.weights_sha256(saved.state_dict()) == ranks[0].weights_sha256
    assert progress.total == data_bench.params["train"]["mlp"]["max_epochs"]
    deadline = time.monotonic() + 10  # epoch events reach the client asynchronously
    while progress.completed < ranks[0].epochs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert progress.completed == ranks[0].epochs


def test_mlp_stage_on_a_cluster_trains_with_ddp_and_keeps_the_best_weights(
    client: Client, data_bench: StageBench
) -> None:
    run_mlp(data_bench, client)

    metrics = data_bench.json("metrics/train_mlp.json")
    mlp = data_bench.params["train"]["mlp"]
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert metrics["best_valid_loss"] < 0.25 * metrics["initial_valid_loss"]
    assert metrics["epochs"] == metrics["best_epoch"] + mlp["patience"] or metrics["epochs"] == mlp["max_epochs"]
    valid = models.read_split(data_bench.root / "data/processed", "valid")
    probability = models.predict_mlp(data_bench.root / "models/mlp.pt", valid.features)
    loss = torch.nn.functional.binary_cross_entropy(
        torch.tensor(probability), torch.tensor(valid.label, dtype=torch.float64)
    )
    # the all-reduced valid loss is the loss over all of valid, and the saved weights are the best
    assert float(loss) == pytest.approx(metrics["best_valid_loss"], abs=1e-5)


def test_a_second_run_on_the_same_cluster_gives_the_same_bytes(client: Client, data_bench: StageBench) -> None:
    """Each run tears its process group down (a second init would fail with "already
    initialized" otherwise), and DDP training is as deterministic as the in-process fit."""
    run_mlp(data_bench, client, max_epochs=15)
    first = (data_bench.root / "models/mlp.pt").read_bytes(), data_bench.json("metrics/train_mlp.json")

    run_mlp(data_bench, client, max_epochs=15)

    assert ((data_bench.root / "models/mlp.pt").read_bytes(), data_bench.json("metrics/train_mlp.json")) == first


def test_a_failing_rank_fails_the_stage_at_once_and_leaves_the_cluster_usable(
    client: Client, data_bench: StageBench, caplog: pytest.LogCaptureFixture
) -> None:
    started = time.monotonic()
    with pytest.raises(
        ddp.RankFailedError,
        match=r"^DDP rank 1 of 2 \(worker tcp://127\.0\.0\.1:\d+\) failed: "
        r"RuntimeError: rank 1 failing on purpose \(train\.mlp\.fail_on_rank: 1\)$",
    ):
        run_mlp(data_bench, client, fail_on_rank=1, collective_timeout_s=120)

    # rank 0 was blocked in a collective with rank 1: it failed when rank 1 left, not at the timeout
    assert time.monotonic() - started < 60
    assert not (data_bench.root / "models/mlp.pt").exists()  # the journal put back what was there: nothing
    assert all(not keys for keys in client.processing().values())  # no rank left running
    assert "failing on purpose" in caplog.text  # the rank's traceback is in the stage's log
    run_mlp(data_bench, client, max_epochs=3)  # a fresh process group on the same workers
    assert data_bench.json("metrics/train_mlp.json")["epochs"] == 3


def test_rank_0_failing_is_reported_as_rank_0(client: Client, data_bench: StageBench) -> None:
    with pytest.raises(ddp.RankFailedError, match=r"^DDP rank 0 of 2 .* failing on purpose"):
        run_mlp(data_bench, client, fail_on_rank=0, collective_timeout_s=120)


def test_the_model_trained_on_workers_loads_on_cpu_in_a_fresh_process(client: Client, data_bench: StageBench) -> None:
    run_mlp(data_bench, client, max_epochs=3)
    model, _ = models.load_mlp(data_bench.root / "models/mlp.pt")
    script = (
        "import sys; from pathlib import Path; from conveyor.train import ddp; from tasks import models; "
        "print(ddp.weights_sha256(models.load_mlp(Path(sys.argv[1]))[0].state_dict()))"
    )

    done = subprocess.run(
        [sys.executable, "-c", script, str(data_bench.root / "models/mlp.pt")],
        cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ddp.weights_sha256(model.state_dict())


def test_ddp_and_xgboost_at_once_on_the_same_one_thread_workers_both_finish(
    client: Client, data_bench: StageBench
) -> None:
    """Both run one blocking task per worker; without conveyor.train.collective.collective_job serialising
    them, worker A could run one job's task and worker B the other's, each waiting forever.

    The outer as_current: Client.as_current sets dask's process-wide config and restores it
    on exit, so two threads leaving theirs out of order would leave it set for later tests.
    """
    with client.as_current(), ThreadPoolExecutor(max_workers=2) as pool:
        stages = [
            pool.submit(run_mlp, data_bench, client, max_epochs=10),
            pool.submit(
                data_bench.run, train.xgboost_model, params=["train.xgb", "seed"], deps=["data/processed"],
                outs=["models/xgb.json"], metrics=["metrics/train_xgb.json"], client=client,
            ),
        ]
        for stage in stages:
            stage.result(timeout=120)

    assert data_bench.json("metrics/train_mlp.json")["world_size"] == 2
    assert data_bench.json("metrics/train_xgb.json")["n_workers"] == 2


def test_ddp_needs_one_process_per_worker(data_bench: StageBench) -> None:
    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address="127.0.0.1:0",
                     scheduler_kwargs={"dashboard": False}) as cl,
        Client(cl, set_as_default=False) as threads,
        pytest.raises(collective.CollectiveError, match=r"^2 workers share 1 process\(es\); this job needs one"),
    ):
        run_mlp(data_bench, threads)


def test_without_a_client_the_mlp_trains_in_process(data_bench: StageBench) -> None:
    """The reference pipeline's train_mlp has no `on:`: no DDP, the metrics of the in-process fit."""
    run_mlp(data_bench, None, max_epochs=3)

    assert sorted(data_bench.json("metrics/train_mlp.json")) == sorted(MLP_METRICS)


@pytest.mark.parametrize(
    ("address", "expected"),
    [("tcp://127.0.0.1:40123", "tcp://127.0.0.1:29500"), ("tcp://[::1]:40123", "tcp://[::1]:29500"),
     ("ucx://10.0.0.7:40123", "tcp://10.0.0.7:29500")],
)
def test_init_method_is_rank_0_workers_host_and_the_free_port(address: str, expected: str) -> None:
    assert ddp.init_method(address, 29500) == expected


def test_ranks_are_the_sorted_worker_addresses(client: Client) -> None:
    workers = collective.ranked_workers(client)

    assert workers == sorted(client.scheduler_info(n_workers=-1)["workers"]) and len(workers) == 2
