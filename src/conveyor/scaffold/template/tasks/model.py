"""Scoring with the trained model: the spec's `model:` section names these two functions.

`conveyor predict` (batch, on a Dask cluster) and `conveyor serve-model` (HTTP) call them
with the model's files and a pandas DataFrame of rows holding the model's feature columns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd


def load(files: Mapping[str, Path]) -> dict[str, Any]:
    """Read the model once per version (``files``: the section's names -> paths): the ridge weights
    and the means and deviations featurize standardised with."""
    model: dict[str, Any] = json.loads(files["model"].read_text(encoding="utf-8"))
    model["scaler"] = json.loads(files["scaler"].read_text(encoding="utf-8"))
    return model


def predict(model: Mapping[str, Any], rows: pd.DataFrame) -> npt.NDArray[np.float64]:
    """One prediction per raw row (the columns of data/raw.csv): standardised as featurize did,
    then the ridge regression scripts/train.py fitted."""
    import numpy as np

    features = model["features"]
    mean = np.asarray([model["scaler"]["mean"][c] for c in features])
    std = np.asarray([model["scaler"]["std"][c] for c in features])
    scaled = (rows[features].to_numpy(dtype="float64") - mean) / std
    return np.asarray(scaled @ np.asarray(model["coef"]) + model["intercept"])
