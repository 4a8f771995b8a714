"""The saved models of the pipeline: how to read a split, rebuild each model and predict.

One place for the file formats (``models/xgb.json``, ``models/mlp.pt``,
``models/stack.json``), shared by training, stacking and evaluation.
"""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd
    import torch
    import xgboost as xgb

    Probabilities = npt.NDArray[np.float64]

BASE_MODELS = ("xgb", "mlp")  # the stack's inputs, in column order
_CLIP = 1e-7


@dataclass(frozen=True)
class Split:
    """One split of data/processed: features in stats.json order, and the label."""

    features: pd.DataFrame
    label: npt.NDArray[np.int64]


def read_split(processed: Path, split: str) -> Split:
    """Read ``data/processed/<split>`` with pandas (the splits are small), page checksums verified:
    a damaged part is a :class:`~conveyor.errors.DamagedFileError` naming it."""
    import numpy as np

    from conveyor.parquet import read_pandas
    from tasks.preprocess import load_stats

    stats = load_stats(processed)
    frame = read_pandas(processed / split)
    return Split(
        features=frame[stats["features"]],
        label=frame[stats["label"]].to_numpy(dtype=np.int64),
    )


def save_xgb(path: Path, booster: xgb.Booster) -> None:
    """The booster as JSON, whatever the file is called.

    ``Booster.save_model`` picks the format from the file's extension, and a spec may name
    the out anything. The model JSON holds the
    trees, not the training configuration (``device`` included): a booster trained with
    ``device="cuda"`` loads and predicts on a machine without a GPU.
    """
    path.write_bytes(bytes(booster.save_raw(raw_format="json")))


def load_xgb(path: Path) -> xgb.Booster:
    """A booster written by :func:`save_xgb`."""
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(bytearray(path.read_bytes()))
    return booster


def predict_xgb(path: Path, features: pd.DataFrame) -> Probabilities:
    """P(label = 1) from a saved booster (already cut at its best round)."""
    return xgb_probabilities(load_xgb(path), features)


def xgb_probabilities(booster: xgb.Booster, features: pd.DataFrame) -> Probabilities:
    import numpy as np
    import xgboost as xgb

    matrix = xgb.DMatrix(features, feature_names=list(features.columns))
    return np.asarray(booster.predict(matrix), dtype=np.float64)


def build_mlp(sizes: list[int]) -> torch.nn.Sequential:
    """Linear layers of the given sizes with ReLU between them; one logit out."""
    import torch

    layers: list[torch.nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def save_mlp(path: Path, model: torch.nn.Sequential, sizes: list[int], features: list[str]) -> None:
    """Save what :func:`load_mlp` needs: layer sizes, feature order and weights.

    The weights are saved as CPU tensors whatever device the model trained on, so a model
    trained on a GPU profile feeds a CPU stage through this file alone.
    """
    import torch

    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    # Through a buffer: saved to a path, torch names the archive's root folder after the file,
    # so the same weights would get other bytes under another file name.
    buffer = io.BytesIO()
    torch.save({"sizes": sizes, "features": features, "state_dict": state}, buffer)
    path.write_bytes(buffer.getvalue())


def load_mlp(path: Path) -> tuple[torch.nn.Sequential, list[str]]:
    """Rebuild the MLP (in eval mode, on CPU) and its feature order; tensors only, no pickled code.

    ``map_location="cpu"``: a file whose tensors were saved on a GPU (by another tool, or
    an older version of :func:`save_mlp`) still loads on a machine without one.
    """
    import torch

    saved: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    model = build_mlp(list(saved["sizes"]))
    model.load_state_dict(saved["state_dict"])
    return model.eval(), list(saved["features"])


def predict_mlp(path: Path, features: pd.DataFrame) -> Probabilities:
    """P(label = 1) from a saved MLP."""
    return mlp_probabilities(*load_mlp(path), features)


def mlp_probabilities(model: torch.nn.Sequential, order: list[str], features: pd.DataFrame) -> Probabilities:
    """P(label = 1) of each row, computed by the row alone: the same score whether the row comes
    alone (a request to the service), among others (a batch) or anywhere among them (evaluate).

    torch's ``model(x)`` does not promise that: its matrix product picks a kernel by the batch's
    shape (a row alone scored otherwise than in a batch: 55 of the 113 test rows), and its
    vectorised sigmoid hands the last values of a tensor to a scalar ``exp`` (two test rows scored
    otherwise among all 569 rows than among the 113). Here each Linear is its bias plus input 0,
    1, ... times their weights, one elementwise product and sum at a time (each exactly rounded,
    wherever the row is), and the sigmoid is NumPy's float64, which computes every value alike.
    """
    import numpy as np
    import torch

    x = torch.tensor(features[order].to_numpy(dtype=np.float32))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                total = layer.bias.expand(len(x), -1)
                for k in range(x.shape[1]):
                    total = total + x[:, k:k + 1] * layer.weight[:, k]
                x = total
            else:
                x = layer(x)
    logits = x.squeeze(1).double().numpy()
    result: Probabilities = 1.0 / (1.0 + np.exp(-logits))
    return result


def base_probabilities(features: pd.DataFrame, xgb_path: Path, mlp_path: Path) -> Probabilities:
    """The stack's input matrix: one column per base model, in ``BASE_MODELS`` order."""
    import numpy as np

    return np.column_stack([predict_xgb(xgb_path, features), predict_mlp(mlp_path, features)])


def stack_inputs(probabilities: Probabilities) -> Probabilities:
    """The stack's features: base probabilities as log-odds (clipped away from 0 and 1).

    On the log-odds scale a logistic regression combines the models as a weighted vote
    and stays calibrated; on raw probabilities its L2 penalty shrinks it to timidity.
    """
    import numpy as np

    p = np.clip(probabilities, _CLIP, 1.0 - _CLIP)
    result: Probabilities = np.log(p / (1.0 - p))
    return result


def save_stack(path: Path, coef: list[float], intercept: float, extra: dict[str, Any]) -> None:
    """The stack as JSON: logistic regression weights over ``stack_inputs``."""
    body = {"inputs": list(BASE_MODELS), "transform": "logit", "coef": coef, "intercept": intercept}
    path.write_text(json.dumps({**body, **extra}, indent=2) + "\n")


def stack_probabilities(saved: dict[str, Any], probabilities: Probabilities) -> Probabilities:
    """P(label = 1) from the stack (its saved JSON), given :func:`base_probabilities`."""
    import numpy as np

    inputs = stack_inputs(probabilities)
    margin = np.full(len(inputs), float(saved["intercept"]))
    for column, weight in enumerate(saved["coef"]):  # not a matrix product: each row's own sum, in one order
        margin = margin + inputs[:, column] * float(weight)
    result: Probabilities = 1.0 / (1.0 + np.exp(-margin))
    return result


@dataclass(frozen=True)
class Ensemble:
    """The three models, loaded once: what evaluate, ``conveyor predict`` and ``serve-model`` score with."""

    booster: xgb.Booster
    mlp: torch.nn.Sequential
    mlp_features: list[str]
    stack: dict[str, Any]

    @classmethod
    def load(cls, xgb_path: Path, mlp_path: Path, stack_path: Path) -> Ensemble:
        return cls(load_xgb(xgb_path), *load_mlp(mlp_path), json.loads(stack_path.read_text()))

    def probabilities(self, features: pd.DataFrame) -> dict[str, Probabilities]:
        """P(label = 1) of each model, keyed by the names used in metrics/test.json."""
        import numpy as np

        base = np.column_stack([xgb_probabilities(self.booster, features),
                                mlp_probabilities(self.mlp, self.mlp_features, features)])
        named = {name: base[:, i] for i, name in enumerate(BASE_MODELS)}
        return {**named, "stack": stack_probabilities(self.stack, base)}
