"""Scoring raw rows with the trained models: what ``conveyor predict`` and ``serve-model`` call.

The spec's ``model:`` section names :func:`load` and :func:`score`. A row is standardised with
the statistics preprocess fitted on the train split (the same function), then scored by the
same :class:`tasks.models.Ensemble` that evaluate uses: a row scores identically in
evaluate, predict and serve.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks import models
from tasks.preprocess import standardise_rows

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd


@dataclass(frozen=True)
class Scorer:
    """The train-split statistics and the loaded models of one model version."""

    features: list[str]
    mean: pd.Series
    std: pd.Series
    ensemble: models.Ensemble


def load(files: Mapping[str, Path]) -> Scorer:
    """Read the model's files once (``stats``: preprocess's stats.json; ``xgb``, ``mlp``, ``stack``)."""
    import pandas as pd

    stats = json.loads(files["stats"].read_text(encoding="utf-8"))
    return Scorer(list(stats["features"]), pd.Series(stats["mean"], dtype="float64"),
                  pd.Series(stats["std"], dtype="float64"),
                  models.Ensemble.load(files["xgb"], files["mlp"], files["stack"]))


def score(scorer: Scorer, rows: pd.DataFrame) -> npt.NDArray[np.float64]:
    """P(target = 1) of each raw row from the stacked model (missing values: the train mean)."""
    features = standardise_rows(rows.astype("float64"), scorer.features, scorer.mean, scorer.std)
    return scorer.ensemble.probabilities(features)["stack"]
