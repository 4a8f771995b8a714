"""Training: xgboost.dask early-stops and beats the constant model, the MLP learns, the stack
is fitted on valid; all from one shared run of the reference chain (see conftest.chain).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from stagebench import REPO, StageBench

from tasks import models, train


def constant_logloss(label: np.ndarray) -> float:
    """Log-loss of always predicting the base rate: what any model must beat."""
    rate = float(label.mean())
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def test_xgboost_early_stops_and_beats_the_constant_model(chain: StageBench) -> None:
    metrics = chain.json("metrics/train_xgb.json")
    valid = models.read_split(chain.root / "data/processed", "valid")
    xgb_params = chain.params["train"]["xgb"]

    assert metrics["n_workers"] == 2 and metrics["device"] == "cpu"
    assert metrics["rounds"] == metrics["best_iteration"] + 1 + xgb_params["early_stopping_rounds"]
    assert metrics["rounds"] < xgb_params["num_boost_round"]
    assert metrics["best_valid_logloss"] < 0.5 * constant_logloss(valid.label)
    booster = models.load_xgb(chain.root / "models/xgb.json")
    assert booster.num_boosted_rounds() == metrics["best_iteration"] + 1  # saved cut at its best round
    assert booster.feature_names == list(valid.features.columns)


def test_xgboost_without_a_client_trains_in_this_process_and_gives_the_same_model(
    chain: StageBench, bench: StageBench
) -> None:
    """A task given no client (a stage placed in process, tests) trains with xgb.train here:
    the same booster, byte for byte, as xgboost.dask on the 2-worker cluster."""
    (bench.root / "data").symlink_to(chain.root / "data", target_is_directory=True)

    bench.run(
        train.xgboost_model,
        params=["train.xgb", "seed"],
        deps=["data/processed"],
        outs=["models/xgb.json"],
        metrics=["metrics/train_xgb.json"],
    )

    assert (bench.root / "models/xgb.json").read_bytes() == (chain.root / "models/xgb.json").read_bytes()
    assert bench.json("metrics/train_xgb.json") == {**chain.json("metrics/train_xgb.json"), "n_workers": 1}


def test_mlp_loss_goes_down_and_keeps_its_best_weights(chain: StageBench) -> None:
    metrics = chain.json("metrics/train_mlp.json")
    mlp_params = chain.params["train"]["mlp"]
    valid = models.read_split(chain.root / "data/processed", "valid")

    assert metrics["best_valid_loss"] < 0.25 * metrics["initial_valid_loss"]
    assert metrics["best_epoch"] <= metrics["epochs"] <= mlp_params["max_epochs"]
    assert (
        metrics["epochs"] == metrics["best_epoch"] + mlp_params["patience"]
        or metrics["epochs"] == mlp_params["max_epochs"]
    )
    probability = models.predict_mlp(chain.root / "models/mlp.pt", valid.features)
    loss = torch.nn.functional.binary_cross_entropy(
        torch.tensor(probability), torch.tensor(valid.label, dtype=torch.float64)
    )
    assert float(loss) == pytest.approx(metrics["best_valid_loss"], abs=1e-5)  # the best weights were saved


def test_mlp_file_loads_with_weights_only(chain: StageBench) -> None:
    saved = torch.load(chain.root / "models/mlp.pt", weights_only=True)

    assert saved["sizes"] == [30, *chain.params["train"]["mlp"]["hidden"], 1]
    assert len(saved["features"]) == 30


def test_stack_is_a_logistic_regression_fitted_on_valid(chain: StageBench) -> None:
    saved = json.loads((chain.root / "models/stack.json").read_text())
    valid_rows = chain.json("data/processed/stats.json")["rows"]["valid"]

    assert saved["inputs"] == ["xgb", "mlp"] and saved["transform"] == "logit"
    assert saved["fitted_on"] == "valid" and saved["rows"] == valid_rows
    assert len(saved["coef"]) == 2 and all(weight > 0 for weight in saved["coef"])


def test_an_mlp_file_with_cuda_tensors_loads_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    """A model trained on a GPU profile feeds CPU stages through its file: load_mlp maps
    tensors saved on ``cuda:0`` to the CPU. The file is written the way a GPU writes it
    (every storage tagged ``cuda:0``, through torch's serialization registry), in a
    separate process, so that the tagging stays out of this one."""
    path = tmp_path / "mlp.pt"
    save = """
        import sys, torch
        from tasks import models
        torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
        torch.manual_seed(0)
        model = models.build_mlp([3, 4, 1])
        torch.save({"sizes": [3, 4, 1], "features": ["a", "b", "c"], "state_dict": model.state_dict()}, sys.argv[1])
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(save), str(path)], cwd=REPO, check=True, timeout=120)

    if not torch.cuda.is_available():  # really tagged cuda:0: without map_location it cannot load here
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(path, weights_only=True)
    model, features = models.load_mlp(path)

    assert features == ["a", "b", "c"] and {p.device.type for p in model.parameters()} == {"cpu"}
    torch.manual_seed(0)
    expected = models.build_mlp([3, 4, 1]).state_dict()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in expected.items())


def test_the_same_mlp_weights_give_the_same_bytes_under_any_file_name(tmp_path: Path) -> None:
    """The runner writes outs under random temporary names: the bytes must not depend on them,
    or DVC sees a changed model (and reruns what follows) after every deterministic retrain."""
    import torch

    from tasks.models import load_mlp, save_mlp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    first, second = tmp_path / ".conveyor-tmp-1a2b-mlp.pt", tmp_path / ".conveyor-tmp-9f8e-mlp.pt"
    for path in (first, second):
        save_mlp(path, model, [3, 2], ["x", "y", "z"])
    assert first.read_bytes() == second.read_bytes()
    loaded, features = load_mlp(first)
    assert features == ["x", "y", "z"]
    assert torch.equal(loaded[0].weight, model[0].weight)
