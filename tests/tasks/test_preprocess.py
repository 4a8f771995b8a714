"""Preprocess: train statistics equal pandas on the whole, the split is exact and stable."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client
from stagebench import StageBench

from tasks import preprocess

BREAST_CANCER = Path(str(importlib.resources.files("sklearn"))) / "datasets/data/breast_cancer.csv"
FRACTIONS = preprocess.Fractions(valid=0.15, test=0.2)
UNEQUAL = [0, 3, 250, 251, 400, 568]  # divisions: partitions of 3, 247, 1, 149 and 169 rows


@pytest.fixture(scope="module")
def raw(params: dict[str, Any]) -> pd.DataFrame:
    """The breast-cancer rows as ingest writes them, with 60 features and 4 labels blanked."""
    columns = params["ingest"]["columns"]
    frame = pd.read_csv(BREAST_CANCER, skiprows=1, header=None, names=columns, dtype="float64")
    rng = np.random.default_rng(0)
    values = frame.to_numpy()
    values[rng.integers(0, len(frame), 60), rng.integers(0, len(columns) - 1, 60)] = np.nan
    values[[5, 77, 300, 568], -1] = np.nan
    return pd.DataFrame(values, columns=columns)


def cleaned(raw: pd.DataFrame) -> pd.DataFrame:
    return raw.dropna(subset=["target"]).astype({"target": "int64"})


def features(frame: pd.DataFrame) -> list[str]:
    return [column for column in frame.columns if column != "target"]


def split_of(
    frame: pd.DataFrame, *, seed: int = 42, divisions: list[int] | None = None, npartitions: int = 1
) -> pd.Series:
    """The split of every row (by index) when the frame is cut into the given partitions.

    Without ``divisions`` the rows keep the order they have in ``frame``.
    """
    ddf = dd.from_pandas(frame, npartitions=npartitions, sort=divisions is not None)
    if divisions is not None:
        ddf = ddf.repartition(divisions=divisions)
    tagged = preprocess.split_rows(ddf, label="target", seed=seed, fractions=FRACTIONS).compute()
    split: pd.Series = tagged[preprocess.SPLIT_COLUMN].sort_index()
    return split


def test_column_stats_equal_pandas_on_unequal_partitions_with_nans(raw: pd.DataFrame) -> None:
    frame = raw[features(raw)]
    ddf = dd.from_pandas(frame, npartitions=1).repartition(divisions=UNEQUAL)
    assert ddf.map_partitions(len).compute().tolist() == [3, 247, 1, 149, 169]
    assert frame.isna().sum().sum() > 50

    stats = preprocess.column_stats(ddf)

    pd.testing.assert_series_equal(stats.count, frame.count(), check_dtype=False)
    np.testing.assert_allclose(stats.mean, frame.mean(), rtol=1e-12)
    np.testing.assert_allclose(stats.std, frame.std(ddof=preprocess.DDOF), rtol=1e-12)


def test_prepare_fits_train_stats_like_pandas_and_writes_standardised_splits(
    bench: StageBench, raw: pd.DataFrame, client: Client
) -> None:
    dd.from_pandas(raw, npartitions=1).repartition(divisions=UNEQUAL).to_parquet(
        bench.root / "data/raw", write_index=False
    )

    bench.run(
        preprocess.prepare, params=["preprocess", "seed"], deps=["data/raw"], outs=["data/processed"], client=client
    )

    stats = bench.json("data/processed/stats.json")
    rows = cleaned(raw).reset_index(drop=True)
    train = rows[split_of(rows) == "train"]
    names = features(rows)
    assert stats["features"] == names and stats["label"] == "target" and stats["ddof"] == 1
    np.testing.assert_allclose(pd.Series(stats["mean"]), train[names].mean(), rtol=1e-12)
    np.testing.assert_allclose(pd.Series(stats["std"]), train[names].std(ddof=1), rtol=1e-12)
    written = pd.read_parquet(bench.root / "data/processed/train")
    expected = (train[names].fillna(train[names].mean()) - train[names].mean()) / train[names].std()
    np.testing.assert_allclose(written[names], expected, rtol=1e-9, atol=1e-12)
    assert written["target"].tolist() == train["target"].tolist()
    assert written["target"].dtype == np.int64
    sizes = {split: len(pd.read_parquet(bench.root / "data/processed" / split)) for split in preprocess.SPLITS}
    assert sizes == stats["rows"] and sum(sizes.values()) == len(raw) - 4  # the 4 unlabelled rows


def test_prepare_writes_the_same_rows_whether_the_cluster_holds_them_or_reads_them_per_pass(
    bench: StageBench, raw: pd.DataFrame, client: Client, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dd.from_pandas(raw, npartitions=1).repartition(divisions=UNEQUAL).to_parquet(
        bench.root / "data/raw", write_index=False
    )
    written: dict[str, dict[str, pd.DataFrame]] = {}
    for way, share in (("held", preprocess.HOLD_SHARE), ("streamed", 0.0)):
        monkeypatch.setattr(preprocess, "HOLD_SHARE", share)
        caplog.clear()
        with caplog.at_level("INFO"):
            bench.run(preprocess.prepare, params=["preprocess", "seed"], deps=["data/raw"], outs=["data/processed"],
                      client=client)
        said = "held in the workers' memory" if way == "held" else "read once per pass"
        assert any(said in record.getMessage() for record in caplog.records), way
        written[way] = {split: pd.read_parquet(bench.root / "data/processed" / split) for split in preprocess.SPLITS}
        # one part per raw partition and split, in partition order, whichever way the rows came
        assert sorted(p.name for p in (bench.root / "data/processed/train").iterdir()) == [
            preprocess.part_name(i) for i in range(len(UNEQUAL) - 1)]

    for split in preprocess.SPLITS:
        pd.testing.assert_frame_equal(written["held"][split], written["streamed"][split])


def test_split_is_exactly_stratified_disjoint_and_complete(raw: pd.DataFrame) -> None:
    rows = cleaned(raw)
    split = split_of(rows)

    assert split.index.equals(rows.index.sort_values())  # every row, each in one split
    assert set(split) == set(preprocess.SPLITS)
    counts = pd.crosstab(split, rows["target"].sort_index()).to_dict()
    for cls in (0, 1):
        n = int((rows["target"] == cls).sum())
        test, test_or_valid = round(n * FRACTIONS.test), round(n * (FRACTIONS.test + FRACTIONS.valid))
        assert counts[cls] == {"test": test, "valid": test_or_valid - test, "train": n - test_or_valid}


def test_split_is_seeded_and_independent_of_partitioning(raw: pd.DataFrame) -> None:
    rows = cleaned(raw).reset_index(drop=True)
    reference = split_of(rows)

    pd.testing.assert_series_equal(split_of(rows, divisions=[0, 3, 250, 251, 400, len(rows) - 1]), reference)
    pd.testing.assert_series_equal(split_of(rows, npartitions=7), reference)
    shuffled = rows.sample(frac=1.0, random_state=1)
    pd.testing.assert_series_equal(split_of(shuffled, npartitions=3), reference)  # and of row order
    assert (split_of(rows, seed=43) != reference).sum() > 100


def test_rows_without_label_are_dropped_and_label_becomes_int(raw: pd.DataFrame) -> None:
    frame = preprocess.clean(dd.from_pandas(raw, npartitions=3), "target").compute()

    assert len(frame) == len(raw) - 4
    assert frame["target"].dtype == np.int64


def test_bad_fractions_are_rejected() -> None:
    with pytest.raises(ValueError, match="sum below 1"):
        preprocess.Fractions(valid=0.5, test=0.5)
