"""Preprocess on bad raw data: a ValueError that names the data, the column or the part, and what to do.

Each test writes a small ``data/raw`` of parquet parts, as ingest does, and runs the task
on the session's Dask cluster, as the runner does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from distributed import Client
from stagebench import StageBench

from tasks import preprocess

ROWS = 60
PARTS = 3
RERUN = "rerun the stage that writes data/raw (conveyor run ingest)"


def rows(**columns: Any) -> pd.DataFrame:
    """Three float features and a 0/1 float ``target`` (as the CSV ingest writes it), with ``columns`` replaced."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({name: rng.normal(size=ROWS) for name in ("a", "b", "c")})
    frame["target"] = (np.arange(ROWS) % 2).astype("float64")
    return frame.assign(**columns)


def write_parts(bench: StageBench, frame: pd.DataFrame) -> Path:
    """``data/raw/part-0000{0,1,2}.parquet``: the frame in ``PARTS`` parts, named as ingest names them."""
    raw = bench.root / "data/raw"
    raw.mkdir(parents=True)
    for index, part in enumerate(np.array_split(np.arange(len(frame)), PARTS)):
        frame.iloc[part].to_parquet(raw / f"part-{index:05d}.parquet", index=False)
    return raw


def run_prepare(bench: StageBench, client: Client, **preprocess_params: Any) -> None:
    overrides = {"preprocess": {**bench.params["preprocess"], **preprocess_params}}
    bench.run(
        preprocess.prepare,
        params=["preprocess", "seed"],
        deps=["data/raw"],
        outs=["data/processed"],
        client=client,
        overrides=overrides,
    )


def test_missing_label_column_is_named_with_the_columns_there(bench: StageBench, client: Client) -> None:
    write_parts(bench, rows())

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client, label="outcome")

    assert str(raised.value) == (
        "preprocess: label column 'outcome' is not in data/raw (columns: a, b, c, target): "
        "set preprocess.label to one of them"
    )


def test_label_with_one_class_is_rejected(bench: StageBench, client: Client) -> None:
    write_parts(bench, rows(target=np.where(np.arange(ROWS) % 5 == 0, np.nan, 1.0)))

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    assert str(raised.value) == (
        "preprocess: label 'target' has one class (1) in data/raw: a classifier needs at least two"
    )


def test_label_missing_on_every_row_is_rejected(bench: StageBench, client: Client) -> None:
    write_parts(bench, rows(target=np.full(ROWS, np.nan)))

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    assert str(raised.value).startswith("preprocess: no row of data/raw has a label 'target' ")
    assert "set preprocess.label" in str(raised.value)


def test_non_numeric_feature_is_named_with_its_dtype(bench: StageBench, client: Client) -> None:
    write_parts(bench, rows(b=[f"v{i}" for i in range(ROWS)]))

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    message = str(raised.value)
    # string, or object where dask's dataframe.convert-string is off
    assert re.match(r"preprocess: column 'b' of data/raw is (string|object), not numeric: ", message)
    assert "ingest.dtype" in message


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("part-00001.parquet", "truncate"),  # opened by a task on a worker, at compute time
        ("part-00001.parquet", "replace"),  # not parquet at all
        ("part-00000.parquet", "truncate"),  # the first part: its footer is read by read_parquet itself
        ("part-00002.parquet", "empty"),
    ],
)
def test_unreadable_part_is_named(bench: StageBench, client: Client, name: str, damage: str) -> None:
    part = write_parts(bench, rows()) / name
    data = part.read_bytes()
    part.write_bytes({"truncate": data[: len(data) // 2], "replace": b"a,b,c,target\n1,2,3,0\n", "empty": b""}[damage])

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    message = str(raised.value)
    assert message.startswith(f"preprocess: data/raw/{name} is not a readable parquet file (")
    assert message.endswith(f"): {RERUN}")
    assert ("magic bytes" in message) if damage != "empty" else ("0 bytes" in message)
    assert not (bench.root / "data/processed").exists()  # nothing half written is left


def test_directory_without_parts_is_rejected(bench: StageBench, client: Client) -> None:
    (bench.root / "data/raw").mkdir(parents=True)
    (bench.root / "data/raw/.part-00000.parquet.tmp").write_bytes(b"left by a cancelled ingest")

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    assert str(raised.value) == f"preprocess: data/raw holds no parquet parts: {RERUN}"
