"""The data stages: a synthetic regression data set, then standardised features on Dask."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd

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


def featurize(ctx: StageContext) -> None:
    """Standardise every feature column with dask.dataframe, on the stage's Dask cluster."""
    import dask.dataframe as dd

    frame = dd.read_csv(str(ctx.dep()))
    features = [c for c in frame.columns if c != "y"]
    mean, std = frame[features].mean().compute(), frame[features].std().compute()
    standardise(frame, mean, std).to_parquet(str(ctx.out()), write_index=False)
    ctx.log.info("standardised %d features on %d Dask workers", len(features), ctx.n_workers)


def standardise(frame: dd.DataFrame, mean: pd.Series, std: pd.Series) -> dd.DataFrame:
    """Features centred and scaled; the other columns as they are."""
    scaled: dd.DataFrame = frame.assign(**{c: (frame[c] - mean[c]) / std[c] for c in mean.index})
    return scaled
