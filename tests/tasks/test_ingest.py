"""Ingest: byte-range blocks fetched on a thread pool give exactly the source's rows, in order."""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pytest
from stagebench import StageBench

from conveyor.ingest.fetch import SourceError, expand_template
from tasks import ingest

T = TypeVar("T")
BREAST_CANCER = Path(str(importlib.resources.files("sklearn"))) / "datasets/data/breast_cancer.csv"


def expected_rows(path: Path, columns: list[str], skip_rows: int) -> pd.DataFrame:
    return pd.read_csv(path, skiprows=skip_rows, header=None, names=columns, dtype="float64")


def ingested(bench: StageBench) -> pd.DataFrame:
    parts = sorted((bench.root / "data/raw").glob("part-*.parquet"))
    return pd.concat([pd.read_parquet(part) for part in parts], ignore_index=True)


def run_ingest(bench: StageBench, executor: Executor | None = None, **overrides: Any) -> None:
    """Run fetch with ``ingest`` params from params.yaml, some keys overridden."""
    params = {**bench.params["ingest"], **overrides}
    bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], executor=executor, overrides={"ingest": params})


class CountingExecutor(ThreadPoolExecutor):
    """A real thread pool that counts what it was given."""

    submitted = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def small_csv(tmp_path: Path) -> Path:
    """The header and first 60 rows of the breast-cancer file (about 12 KB)."""
    path = tmp_path / "src" / "small.csv"
    path.parent.mkdir()
    path.write_text("".join(BREAST_CANCER.read_text().splitlines(keepends=True)[:61]))
    return path


def test_reference_source_gives_every_row_in_order(bench: StageBench) -> None:
    """params.yaml as it is: the package template, 12 blocks fetched concurrently."""
    ctx = bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"])
    columns = bench.params["ingest"]["columns"]

    pd.testing.assert_frame_equal(ingested(bench), expected_rows(BREAST_CANCER, columns, 1))
    assert len(columns) == 31 and columns[0] == "mean_radius" and columns[-1] == "target"
    data_bytes = BREAST_CANCER.stat().st_size - len(BREAST_CANCER.read_bytes().split(b"\n", 1)[0]) - 1
    assert ctx.progress.unit == "MB"
    assert ctx.progress.total == pytest.approx(data_bytes / 1e6)
    assert ctx.progress.completed == pytest.approx(ctx.progress.total)
    assert ctx.progress.description.startswith("12/12 blocks, ")  # blocks of 10000 bytes, and the rate


@pytest.mark.parametrize("block_size", [7, 300, 4096, 10**9], ids=["below-a-line", "~line", "4k", "above-file"])
def test_blocks_of_any_size_give_each_line_once(bench: StageBench, small_csv: Path, block_size: int) -> None:
    run_ingest(bench, sources=[f"file://{small_csv}"], block_size=block_size)

    columns = bench.params["ingest"]["columns"]
    pd.testing.assert_frame_equal(ingested(bench), expected_rows(small_csv, columns, 1))


def test_no_header_no_trailing_newline(bench: StageBench, tmp_path: Path) -> None:
    path = tmp_path / "plain.csv"
    path.write_text("1,2\n3,4\n5,6\n7,8")

    run_ingest(bench, sources=[str(path)], skip_rows=0, columns=["a", "b"], block_size=3, dtype="int64")

    assert ingested(bench).to_dict("list") == {"a": [1, 3, 5, 7], "b": [2, 4, 6, 8]}


def test_glob_reads_matches_in_sorted_order_on_the_given_executor(bench: StageBench, tmp_path: Path) -> None:
    (tmp_path / "b.csv").write_text("h\n3,4\n")
    (tmp_path / "a.csv").write_text("h\n1,2\n")
    (tmp_path / "c.txt").write_text("h\n9,9\n")

    with CountingExecutor(max_workers=2) as pool:
        run_ingest(bench, executor=pool, sources=[f"file://{tmp_path}/*.csv"], columns=["x", "y"], block_size=2)

    assert ingested(bench).to_dict("list") == {"x": [1.0, 3.0], "y": [2.0, 4.0]}
    # on this pool: the glob's listing, each file's header offset, 3 blocks of 2 bytes per 6-byte file
    assert pool.submitted == 1 + 2 + 6


def test_missing_source_names_its_url(bench: StageBench, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/nope.csv"
    with pytest.raises(SourceError, match=r"cannot ingest source 'file://.*/nope\.csv'"):
        run_ingest(bench, sources=[f"file://{BREAST_CANCER}", url])


def test_unparsable_block_names_its_url_and_byte_range(bench: StageBench, tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("1,2\n3,4\nfive,6\n")

    with pytest.raises(SourceError, match=r"'.*bad\.csv': .*bad\.csv bytes \d+\+\d+: line 1 of the block, "
                                          r"column 'a': 'five' cannot be read as int64"):
        run_ingest(bench, sources=[str(path)], skip_rows=0, columns=["a", "b"], block_size=4, dtype="int64")


def test_glob_without_match_names_its_url(bench: StageBench, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"'.*/\*\.parquet': .*no files match the pattern"):
        run_ingest(bench, sources=[f"{tmp_path}/*.parquet"])


def test_package_template_resolves_to_the_installed_package() -> None:
    url = expand_template("file://{package:sklearn}/datasets/data/breast_cancer.csv")
    assert url == f"file://{BREAST_CANCER}"
