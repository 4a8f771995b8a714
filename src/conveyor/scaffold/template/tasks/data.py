"""The first stage: a synthetic regression data set.

One module per stage's task: conveyor fingerprints a task by the source of its module and of
the project's modules it imports, so a stage in a module of its own reruns only when its own
code changes (an edit to featurize does not rerun make_data).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor import StageContext


def make_data(ctx: StageContext) -> None:
    """``rows`` rows of ``features`` normal features and a linear target with noise, seeded."""
    import numpy as np
    import pandas as pd

    params = ctx.params["make_data"]
    rng = np.random.default_rng(int(ctx.params["seed"]))
    x = rng.normal(size=(int(params["rows"]), int(params["features"])))
    weights = np.arange(1, x.shape[1] + 1, dtype=float)
    y = x @ weights + rng.normal(scale=float(params["noise"]), size=len(x))
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(x.shape[1])]).assign(y=y)
    frame.to_csv(ctx.out(), index=False)  # the declared out, written in place
    ctx.log.info("wrote %d rows to %s", len(frame), ctx.out())
