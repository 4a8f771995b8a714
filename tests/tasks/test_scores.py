"""A row's score is the row's own: the same alone (a request to the service), in a batch of any
size and anywhere in it (evaluate, ``conveyor predict``'s partitions).

torch's matrix product and vectorised sigmoid did not promise that: a row alone scored otherwise
than in a batch, and the last values of a tensor went through another ``exp`` than the rest.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from tasks import models

FEATURES = [f"f{i}" for i in range(30)]


def _rows(n: int, seed: int) -> pd.DataFrame:
    return pd.DataFrame(np.random.default_rng(seed).standard_normal((n, len(FEATURES))), columns=FEATURES)


def test_a_rows_mlp_and_stack_scores_do_not_depend_on_the_rows_beside_it() -> None:
    torch.manual_seed(3)
    mlp = models.build_mlp([len(FEATURES), 32, 16, 1]).eval()
    stack = {"coef": [0.8, 1.7], "intercept": -0.2}
    rows = _rows(1003, seed=1)  # not a multiple of any vector width: a tail at the end

    def scores(frame: pd.DataFrame) -> dict[str, np.ndarray]:
        mlp_p = models.mlp_probabilities(mlp, FEATURES, frame)
        other = 1.0 / (1.0 + np.exp(-frame["f0"].to_numpy()))  # a second base model: the row's own too
        return {"mlp": mlp_p, "stack": models.stack_probabilities(stack, np.column_stack([other, mlp_p]))}

    whole = scores(rows)
    alone = [scores(rows.iloc[[i]]) for i in range(0, len(rows), 7)]  # the service, one row a request
    order = np.random.default_rng(2).permutation(len(rows))
    shuffled = scores(rows.iloc[order].reset_index(drop=True))
    tail = scores(rows.iloc[990:].reset_index(drop=True))  # the last rows, as a batch of their own
    part = scores(rows.iloc[5:900].reset_index(drop=True))
    for name in ("mlp", "stack"):
        assert [one[name][0] for one in alone] == whole[name][::7].tolist(), name
        assert (shuffled[name][np.argsort(order)] == whole[name]).all(), name
        assert (tail[name] == whole[name][990:]).all() and (part[name] == whole[name][5:900]).all(), name
