"""Preprocess on bad raw data: a ValueError that names the data, the column or the part, and what to do.

Each test writes a small ``data/raw`` of parquet parts, as ingest does, and runs the task
on the session's Dask cluster, as the runner does. A part whose pages are damaged (its footer
intact, so that it opens) is named too, by every task that reads parquet: the pipeline writes a
CRC per page and its readers verify them; parts written without CRCs still read.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from distributed import Client
from parquet_damage import damage_page
from stagebench import StageBench

from conveyor.errors import DamagedFileError
from conveyor.parquet import read_dask, read_pandas, read_table
from tasks import evaluate, ingest, preprocess, train

ROWS = 60
PARTS = 3
RERUN = "rerun the stage that writes data/raw (conveyor run ingest)"
RERUN_INGEST = "rerun the stage that writes data/raw (conveyor run --force ingest)"
RERUN_PREPROCESS = "rerun the stage that writes data/processed (conveyor run --force preprocess)"
FAILED_CRC = (r"a page fails its checksum \(pyarrow: could not verify page integrity, "
              r"CRC checksum verification failed for page_ordinal \d+\)")


def rows(**columns: Any) -> pd.DataFrame:
    """Three float features and a 0/1 float ``target`` (as the CSV ingest writes it), with ``columns`` replaced."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({name: rng.normal(size=ROWS) for name in ("a", "b", "c")})
    frame["target"] = (np.arange(ROWS) % 2).astype("float64")
    return frame.assign(**columns)


def write_parts(bench: StageBench, frame: pd.DataFrame, *, checksums: bool = True) -> Path:
    """``data/raw/part-0000{0,1,2}.parquet``: the frame in ``PARTS`` parts, named and written as
    ingest writes them (pandas, a CRC per page); ``checksums=False``: as ingest wrote them before."""
    raw = bench.root / "data/raw"
    raw.mkdir(parents=True)
    for index, part in enumerate(np.array_split(np.arange(len(frame)), PARTS)):
        frame.iloc[part].to_parquet(raw / f"part-{index:05d}.parquet", index=False, write_page_checksum=checksums)
    return raw


def run_prepare(bench: StageBench, client: Client | None, **preprocess_params: Any) -> None:
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


@pytest.mark.parametrize(
    ("name", "on_cluster"),
    [
        ("part-00001.parquet", True),  # read by a task on a worker
        ("part-00000.parquet", True),  # the first part, whose footer read_parquet reads itself
        ("part-00002.parquet", False),  # no cluster: small data read at once, in this process
    ],
)
def test_part_with_a_damaged_page_is_named(bench: StageBench, client: Client, name: str, on_cluster: bool) -> None:
    frame = rows()
    part = write_parts(bench, frame) / name
    damage_page(part)
    # what the checksums are for: unverified, the damaged part reads without an error, as other values
    index = int(name[5:10])
    unverified = pd.read_parquet(part)
    assert unverified.shape == (20, 4) and not unverified.equals(frame.iloc[index * 20:(index + 1) * 20]
                                                                  .reset_index(drop=True))

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client if on_cluster else None)

    assert re.fullmatch(rf"preprocess: data/raw/{name} is damaged: {FAILED_CRC}: {re.escape(RERUN_INGEST)}",
                        str(raised.value)), str(raised.value)
    assert not (bench.root / "data/processed").exists()  # nothing half written is left


@pytest.mark.parametrize("source", ["csv", "synthetic"])
def test_part_ingest_wrote_then_damaged_is_named(bench: StageBench, client: Client, source: str) -> None:
    """Parts as the real ingest writes them (CSV blocks parsed by pandas, synthetic shards by pyarrow)."""
    ingest_params = bench.params["ingest"] if source == "csv" else {
        "sources": [{"kind": "synthetic", "rows": 2000, "shards": 2, "seed": 1}]}
    bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], overrides={"ingest": ingest_params})
    damage_page(bench.root / "data/raw/part-00001.parquet")

    with pytest.raises(ValueError) as raised:
        run_prepare(bench, client)

    assert re.fullmatch(rf"preprocess: data/raw/part-00001.parquet is damaged: {FAILED_CRC}: {re.escape(RERUN_INGEST)}",
                        str(raised.value)), str(raised.value)


@pytest.mark.parametrize("on_cluster", [True, False])
def test_parts_written_without_checksums_still_read(bench: StageBench, client: Client, on_cluster: bool) -> None:
    """Parts ingest wrote before it wrote checksums: pyarrow verifies only the pages that carry one."""
    frame = rows()
    raw = write_parts(bench, frame, checksums=False)

    run_prepare(bench, client if on_cluster else None)

    assert sum(bench.json("data/processed/stats.json")["rows"].values()) == ROWS
    pd.testing.assert_frame_equal(read_pandas(raw), frame)
    pd.testing.assert_frame_equal(read_dask(raw).compute(scheduler="sync").reset_index(drop=True), frame)
    pd.testing.assert_frame_equal(read_table(raw / "part-00000.parquet").to_pandas(), frame.iloc[:20])


def test_pages_without_checksums_are_read_unverified(tmp_path: Path) -> None:
    """pyarrow's verification skips a page that has no CRC: a file written without them, damaged,
    reads as before (other values, no error); the same damage to a file with CRCs is named."""
    frame = rows()
    old, new = tmp_path / "old.parquet", tmp_path / "new.parquet"
    frame.to_parquet(old, index=False)
    frame.to_parquet(new, index=False, write_page_checksum=True)
    damage_page(old)
    damage_page(new)

    assert read_table(old).num_rows == ROWS and not read_pandas(old).equals(frame)
    with pytest.raises(DamagedFileError) as raised:
        read_table(new)
    assert raised.value.path == str(new)
    assert re.fullmatch(rf"{re.escape(str(new))} is damaged: {FAILED_CRC}: write it again", str(raised.value))


def _xgboost_on_cluster(bench: StageBench, client: Client) -> None:
    bench.run(train.xgboost_model, params=["train.xgb", "seed"], deps=["data/processed"], outs=["models/xgb.json"],
              metrics=["metrics/train_xgb.json"], client=client)


def _xgboost_here(bench: StageBench, client: Client) -> None:
    bench.run(train.xgboost_model, params=["train.xgb", "seed"], deps=["data/processed"], outs=["models/xgb.json"],
              metrics=["metrics/train_xgb.json"])


def _mlp_here(bench: StageBench, client: Client) -> None:
    bench.run(train.mlp_model, params=["train.mlp", "seed"], deps=["data/processed"], outs=["models/mlp.pt"],
              metrics=["metrics/train_mlp.json"])


def _stack(bench: StageBench, client: Client) -> None:
    bench.run(train.stack, params=["train.stack", "seed"],
              deps={"data": "data/processed", "xgb": "models/xgb.json", "mlp": "models/mlp.pt"},
              outs=["models/stack.json"])


def _evaluate(bench: StageBench, client: Client) -> None:
    bench.run(evaluate.evaluate, params=["evaluate"],
              deps={"data": "data/processed", "xgb": "models/xgb.json", "mlp": "models/mlp.pt",
                    "stack": "models/stack.json"},
              outs=["plots/roc.png"], metrics=["metrics/test.json"])


@pytest.mark.parametrize(
    ("run", "stage", "split"),
    [
        (_xgboost_on_cluster, "xgboost_model", "valid"),  # dask, parts read on the workers
        (_xgboost_here, "xgboost_model", "valid"),  # dask, in this process
        (_mlp_here, "mlp_model", "valid"),  # pandas: the split's directory at once
        (_stack, "stack", "valid"),
        (_evaluate, "evaluate", "test"),
    ],
)
def test_split_with_a_damaged_page_is_named_by_the_task_that_reads_it(
    chain: StageBench, bench: StageBench, client: Client, run: Callable[[StageBench, Client], None], stage: str,
    split: str,
) -> None:
    """The splits as preprocess wrote them (the shared chain's, copied), one part damaged."""
    shutil.copytree(chain.root / "data/processed", bench.root / "data/processed")
    shutil.copytree(chain.root / "models", bench.root / "models")
    part = sorted((bench.root / "data/processed" / split).glob("part-*.parquet"))[-1]
    damage_page(part)

    with pytest.raises(ValueError) as raised:
        run(bench, client)

    shown = f"data/processed/{split}/{part.name}"
    assert re.fullmatch(rf"{stage}: {shown} is damaged: {FAILED_CRC}: {re.escape(RERUN_PREPROCESS)}",
                        str(raised.value)), str(raised.value)
