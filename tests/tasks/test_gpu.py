"""The GPU profile for real: a dask-cuda LocalCUDACluster (one worker per GPU), xgboost.dask
with ``device="cuda"``, torch DDP over NCCL, and GPU-trained models read by CPU stages.

Skipped without an NVIDIA GPU (checked at collection) or without dask-cuda; run with
``pytest -m gpu tests/tasks/test_gpu.py`` on a machine with ``pip install 'conveyor[gpu]'``.
Data comes from the shared reference chain (conftest.chain, on the CPU cluster).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from distributed import Client
from stagebench import REPO, StageBench, Task

from conveyor import StageProgress
from conveyor.train import ddp
from tasks import evaluate, mlp, mlp_ddp, models, train

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs an NVIDIA GPU (torch sees none)")]
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a fresh process that sees no GPU


@pytest.fixture(scope="module")
def cuda_client() -> Iterator[Client]:
    """The `gpu` profile: LocalCUDACluster as conveyor.run.profiles starts it, one worker per GPU."""
    dask_cuda = pytest.importorskip("dask_cuda")
    with (
        dask_cuda.LocalCUDACluster(dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False}) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        client.wait_for_workers(GPUS, timeout=120)
        yield client


def run_on_gpus(
    bench: StageBench,
    task: Task,
    client: Client,
    *,
    params: Sequence[str],
    deps: Sequence[str],
    outs: Sequence[str],
    metrics: Sequence[str],
    overrides: dict[str, Any] | None = None,
) -> None:
    """StageBench.run with the GPU profile's ``devices`` set, as the runner sets them."""
    bench.run(task, params=params, deps=deps, outs=outs, metrics=metrics, client=client, overrides=overrides,
              devices=tuple(range(GPUS)))


def run_mlp_on_gpus(bench: StageBench, client: Client, **overrides: Any) -> None:
    run_on_gpus(
        bench, train.mlp_model, client,
        params=["train.mlp", "seed"], deps=["data/processed"], outs=["models/mlp.pt"],
        metrics=["metrics/train_mlp.json"], overrides={"train.mlp": {**bench.params["train"]["mlp"], **overrides}},
    )


@pytest.fixture(scope="module")
def gpu_models(
    tmp_path_factory: pytest.TempPathFactory, chain: StageBench, params: dict[str, Any], cuda_client: Client
) -> StageBench:
    """train_xgb and train_mlp on the GPU profile, once, over the chain's data."""
    bench = StageBench(tmp_path_factory.mktemp("gpu"), params)
    (bench.root / "data").symlink_to(chain.root / "data", target_is_directory=True)
    run_on_gpus(
        bench, train.xgboost_model, cuda_client,
        params=["train.xgb", "seed"], deps=["data/processed"], outs=["models/xgb.json"],
        metrics=["metrics/train_xgb.json"],
    )
    run_mlp_on_gpus(bench, cuda_client)
    return bench


def in_cpu_process(script: str, *args: str) -> str:
    """Run ``script`` in a fresh interpreter that sees no GPU; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO, env=CPU_ONLY, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- the cluster -----------------------------------------------------------------------------


def _first_visible_device() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]


def _sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_local_cuda_cluster_runs_one_worker_per_gpu_each_on_its_own(cuda_client: Client) -> None:
    first = cuda_client.run(_first_visible_device)

    assert len(first) == GPUS
    assert len(set(first.values())) == GPUS  # dask-cuda puts each worker's own GPU first
    assert all(cuda_client.run(_sees_a_gpu).values())


def test_the_gpu_profile_declares_one_gpu_per_worker_for_the_stages_resources() -> None:
    """conveyor's dask-cuda profile, started as a run starts it: each worker declares GPU=1, which a
    stage's `resources: {GPU: k}` holds (conveyor.run.held)."""
    pytest.importorskip("dask_cuda")
    from conveyor.run.profiles import Profiles
    from conveyor.spec.profiles import DaskCudaProfile

    with Profiles({"gpu": DaskCudaProfile(kind="dask-cuda")}) as profiles:
        client = profiles.get("gpu").client
        assert client is not None
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert len(workers) == GPUS and all(w["resources"] == {"GPU": 1} for w in workers.values())


# --- xgboost.dask on cuda ----------------------------------------------------------------------


def _xgboost_has_cuda() -> bool:
    import xgboost

    return bool(xgboost.build_info()["USE_CUDA"])


def test_xgboost_trains_on_cuda_on_every_worker(cuda_client: Client, gpu_models: StageBench) -> None:
    metrics = gpu_models.json("metrics/train_xgb.json")
    valid = models.read_split(gpu_models.root / "data/processed", "valid")
    rate = float(valid.label.mean())

    assert all(cuda_client.run(_xgboost_has_cuda).values())  # device="cuda" is not silently the CPU
    assert metrics["device"] == "cuda" and metrics["n_workers"] == GPUS
    assert metrics["best_valid_logloss"] < 0.5 * -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def test_gpu_trained_booster_predicts_the_same_on_cpu_in_a_fresh_process(gpu_models: StageBench) -> None:
    processed, booster = gpu_models.root / "data/processed", gpu_models.root / "models/xgb.json"
    here = models.predict_xgb(booster, models.read_split(processed, "valid").features)

    out = in_cpu_process(
        """
        import json, sys
        from pathlib import Path
        from tasks import models
        features = models.read_split(Path(sys.argv[1]), "valid").features
        print(json.dumps(models.predict_xgb(Path(sys.argv[2]), features).tolist()))
        """,
        str(processed), str(booster),
    )

    assert "device" not in json.loads(booster.read_text())["learner"]  # the file holds trees, not a device
    np.testing.assert_allclose(np.asarray(json.loads(out)), here, rtol=0, atol=1e-6)


# --- DDP over NCCL -----------------------------------------------------------------------------


def test_ddp_over_nccl_trains_one_rank_per_gpu_to_identical_weights(
    cuda_client: Client, gpu_models: StageBench
) -> None:
    params = mlp.MlpParams.from_params(gpu_models.params["train"]["mlp"])
    out = gpu_models.root / "models/ddp-nccl.pt"
    job = mlp_ddp.DdpJob(str(gpu_models.root / "data/processed"), str(out), params, seed=42)

    ranks = mlp_ddp.train(cuda_client, job, gpu=True, progress=StageProgress(), log=logging.getLogger("tests.gpu"))

    assert [rank.rank for rank in ranks] == list(range(GPUS))
    assert {rank.device for rank in ranks} == {"cuda:0"}  # each worker's own GPU
    assert len({rank.weights_sha256 for rank in ranks}) == 1
    assert ranks[0].best_valid_loss < 0.25 * ranks[0].initial_valid_loss
    assert ddp.weights_sha256(models.load_mlp(out)[0].state_dict()) == ranks[0].weights_sha256


def test_mlp_stage_on_the_gpu_profile_uses_nccl(gpu_models: StageBench) -> None:
    metrics = gpu_models.json("metrics/train_mlp.json")

    assert metrics["backend"] == "nccl" and metrics["world_size"] == GPUS
    assert metrics["best_valid_loss"] < 0.25 * metrics["initial_valid_loss"]


def test_a_failing_nccl_rank_fails_the_stage_and_the_cluster_stays_usable(
    cuda_client: Client, gpu_models: StageBench, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bench = StageBench(tmp_path_factory.mktemp("gpu-fail"), gpu_models.params)
    (bench.root / "data").symlink_to(gpu_models.root / "data", target_is_directory=True)
    last = GPUS - 1

    with pytest.raises(ddp.RankFailedError, match=rf"^DDP rank {last} of {GPUS} .* failing on purpose"):
        run_mlp_on_gpus(bench, cuda_client, fail_on_rank=last, collective_timeout_s=120)

    assert all(not keys for keys in cuda_client.processing().values())
    run_mlp_on_gpus(bench, cuda_client, max_epochs=3)
    assert bench.json("metrics/train_mlp.json")["epochs"] == 3


# --- GPU-trained models feed CPU stages through their files -----------------------------------


def test_gpu_trained_mlp_loads_on_cpu_in_a_fresh_process(gpu_models: StageBench) -> None:
    path = gpu_models.root / "models/mlp.pt"

    out = in_cpu_process(
        """
        import sys
        from pathlib import Path
        from tasks import models
        from conveyor.train import ddp
        print(ddp.weights_sha256(models.load_mlp(Path(sys.argv[1]))[0].state_dict()))
        """,
        str(path),
    )

    assert out.strip() == ddp.weights_sha256(models.load_mlp(path)[0].state_dict())


def test_a_checkpoint_saved_with_cuda_tensors_loads_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Not through save_mlp (which moves weights to the CPU): the map_location of load_mlp."""
    path = tmp_path_factory.mktemp("cuda-checkpoint") / "mlp.pt"
    model = models.build_mlp([3, 4, 1]).to("cuda")
    torch.save({"sizes": [3, 4, 1], "features": ["a", "b", "c"], "state_dict": model.state_dict()}, path)

    out = in_cpu_process(
        """
        import sys, torch
        from pathlib import Path
        from tasks import models
        try:
            torch.load(sys.argv[1], weights_only=True)
        except RuntimeError:
            print("cuda tensors")
        model, features = models.load_mlp(Path(sys.argv[1]))
        print({p.device.type for p in model.parameters()}, features)
        """,
        str(path),
    )

    assert out.splitlines() == ["cuda tensors", "{'cpu'} ['a', 'b', 'c']"]


def test_cpu_stages_stack_and_evaluate_gpu_trained_models(gpu_models: StageBench) -> None:
    named = {"data": "data/processed", "xgb": "models/xgb.json", "mlp": "models/mlp.pt"}  # as the spec names them
    gpu_models.run(train.stack, params=["train.stack", "seed"], deps=named, outs=["models/stack.json"])
    gpu_models.run(
        evaluate.evaluate, params=["evaluate"], deps={**named, "stack": "models/stack.json"},
        outs=["plots/roc.png"], metrics=["metrics/test.json"],
    )

    assert gpu_models.json("metrics/test.json")["stack"]["auc"] >= 0.97
