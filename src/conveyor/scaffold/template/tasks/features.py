"""Standardised features, computed with dask.dataframe: on the stage's Dask cluster, or in
conveyor's process while the input is under the profile's ``in_process_below``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd

    from conveyor import StageContext


def featurize(ctx: StageContext) -> None:
    """Standardise every feature column with dask.dataframe (on the cluster when there is one), and
    keep the means and deviations used: the model scores raw rows by standardising them the same way."""
    import json

    import dask.dataframe as dd

    frame = dd.read_csv(str(ctx.dep()))
    features = [c for c in frame.columns if c != "y"]
    mean, std = frame[features].mean().compute(), frame[features].std().compute()
    standardise(frame, mean, std).to_parquet(str(ctx.out("features")), write_index=False)
    scaler = {"mean": {c: float(mean[c]) for c in features}, "std": {c: float(std[c]) for c in features}}
    ctx.out("scaler").write_text(json.dumps(scaler, indent=2) + "\n")
    where = f"on {ctx.n_workers} Dask workers" if ctx.client is not None else "in process (a small input)"
    ctx.log.info("standardised %d features %s", len(features), where)


def standardise(frame: dd.DataFrame, mean: pd.Series, std: pd.Series) -> dd.DataFrame:
    """Features centred and scaled; the other columns as they are."""
    scaled: dd.DataFrame = frame.assign(**{c: (frame[c] - mean[c]) / std[c] for c in mean.index})
    return scaled
