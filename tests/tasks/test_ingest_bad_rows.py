"""Bad CSV rows: never padded, shifted or guessed; named (file, line, column) or, with
``on_bad_rows: skip``, left out and kept in ``<out>/_bad_rows/`` with their line and reason."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pytest
from stagebench import StageBench

from conveyor.ingest import fetch_sources
from conveyor.ingest.fetch import SourceError
from conveyor.ingest.params import CsvOptions
from conveyor.ingest.rows import BadRow, BadRowError, read_csv
from tasks import ingest

COLUMNS = ["a", "b", "label"]
DIRTY = (
    "a,b,label\n"       # line 1: the header (skip_rows: 1)
    "1,2,0\n"           # 2
    "3,4\n"             # 3: a field short (pandas would pad it with NaN)
    "5,6,1,9\n"         # 4: a field too many
    "\n"                # 5: blank: not a row, not an error
    "7,seven,1\n"       # 6: not a float
    "8,9,1\n"           # 7
    "10,,0\n"           # 8: a missing value is not a bad row
)


def options(on_bad_rows: str = "error", dtype: str | dict[str, str] | None = "float64") -> CsvOptions:
    return CsvOptions(columns=COLUMNS, dtype=dtype, skip_rows=1, on_bad_rows=on_bad_rows)


def parse(text: str, opts: CsvOptions, rows_per_part: int | None = None) -> tuple[list[pd.DataFrame], list[BadRow]]:
    bad: list[BadRow] = []
    numbered = dict(read_csv(text.encode(), opts, skip_rows=opts.skip_rows, rows_per_part=rows_per_part, bad=bad))
    return [numbered[i].to_pandas() for i in sorted(numbered)], bad


def test_skip_leaves_out_every_bad_row_and_names_its_line() -> None:
    frames, bad = parse(DIRTY, options("skip"))
    rows = pd.concat(frames, ignore_index=True)
    assert rows["a"].tolist() == [1.0, 8.0, 10.0]
    assert rows["b"].isna().tolist() == [False, False, True]
    assert rows.dtypes.map(str).tolist() == ["float64"] * 3
    assert [(r.line, r.column) for r in bad] == [(3, None), (4, None), (6, "b")]
    assert bad[0].reason == "expected 3 fields, found 2" and bad[0].text == "3,4"
    assert bad[1].reason == "expected 3 fields, found 4"
    assert bad[2].reason == "'seven' cannot be read as float64"


@pytest.mark.parametrize(("text", "message"), [
    ("a,b,label\n1,2,0\n3,4\n", "line 3: expected 3 fields, found 2"),
    ("a,b,label\n1,2,0,5\n3,4,1,6\n", "line 2: expected 3 fields, found 4"),  # pandas: shifts every column
    ("a,b,label\n1,2,0\n\n7,seven,1\n", "line 4, column 'b': 'seven' cannot be read as float64"),
])
def test_error_names_the_first_bad_line_and_column(text: str, message: str) -> None:
    with pytest.raises(BadRowError, match=rf"^{message} \(set on_bad_rows: skip"):
        parse(text, options())


def test_lines_are_counted_across_arrow_blocks_and_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    import conveyor.ingest.rows as rows_module

    monkeypatch.setattr(rows_module, "_READ_BLOCK", 64)  # many Arrow blocks of a few rows each
    lines = ["a,b,label"] + [f"{i},{i},{i % 2}" for i in range(1, 200)]
    lines[57] = "57,57"          # line 58
    lines[120] = ""              # line 121: blank
    lines[150] = "150,x,0"       # line 151
    frames, bad = parse("\n".join(lines) + "\n", options("skip", {"a": "int64", "b": "float64", "label": "int64"}),
                        rows_per_part=50)
    assert [len(f) for f in frames] == [50, 50, 50, 46]
    assert [(r.line, r.column) for r in bad] == [(58, None), (151, "b")]
    kept = pd.concat(frames, ignore_index=True)
    assert kept["a"].tolist() == [i for i in range(1, 200) if i not in (57, 120, 150)]
    assert str(kept["a"].dtype) == "int64"


def test_clean_numbers_are_written_as_pandas_writes_them(tmp_path: Path) -> None:
    """Numbers and booleans go from Arrow's parser to the parquet writer without pandas, and the part is
    the same bytes as ``DataFrame.to_parquet(index=False)`` of the same rows (a missing float is null)."""
    import pyarrow.parquet as pq

    text = "a,b,label\n1.5,2,true\n,3,false\n2.5,4,true\n"
    opts = options(dtype={"a": "float64", "b": "int64", "label": "bool"})
    [(number, table)] = list(read_csv(text.encode(), opts, skip_rows=1, rows_per_part=None, bad=[]))
    assert number == 0
    frame = pd.DataFrame({"a": [1.5, float("nan"), 2.5], "b": [2, 3, 4], "label": [True, False, True]})
    pq.write_table(table, tmp_path / "arrow.parquet", write_page_checksum=True)
    frame.to_parquet(tmp_path / "pandas.parquet", index=False, write_page_checksum=True)
    assert (tmp_path / "arrow.parquet").read_bytes() == (tmp_path / "pandas.parquet").read_bytes()


def test_a_missing_integer_is_refused_naming_its_column() -> None:
    opts = options(dtype={"a": "float64", "b": "int64", "label": "int64"})
    with pytest.raises(ValueError, match="column 'b'"):
        parse("a,b,label\n1,2,0\n3,,1\n", opts)


def test_an_integer_column_refuses_a_fraction() -> None:
    frames, bad = parse("a,b,label\n1,2,0\n1,2,0.5\n", options("skip", {"a": "float64", "b": "float64",
                                                                        "label": "int64"}))
    assert [(r.line, r.column, r.reason) for r in bad] == [(3, "label", "'0.5' cannot be read as int64")]
    assert frames[0]["label"].tolist() == [0]


def ingest_params(source: Path, **extra: object) -> dict[str, object]:
    return {"sources": [str(source)], "columns": COLUMNS, "dtype": "float64", "skip_rows": 1, **extra}


@pytest.mark.parametrize("mode", [{"mode": "files", "rows_per_part": 2}, {"block_size": 16}])
def test_skipped_rows_are_quarantined_and_counted(tmp_path: Path, mode: dict[str, object],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "dirty.csv"
    source.write_text(DIRTY)
    out = tmp_path / "raw"
    with caplog.at_level(logging.WARNING):
        done = fetch_sources(ingest_params(source, on_bad_rows="skip", **mode), out)
    assert (done.rows, done.bad_rows) == (3, 3)
    assert "left out 3 bad rows (on_bad_rows: skip)" in caplog.text
    quarantined = [row for path in sorted((out / "_bad_rows").glob("part-*.csv"))
                   for row in csv.DictReader(path.open())]
    assert sorted(r["text"] for r in quarantined) == ["3,4", "5,6,1,9", "7,seven,1"]
    assert {r["source"] for r in quarantined} == {str(source)}
    if mode.get("mode") == "files":  # lines of the file; a block counts its own
        assert [(r["line"], r["column"]) for r in quarantined] == [("3", ""), ("4", ""), ("6", "b")]
    frame = dd.read_parquet(str(out)).compute()  # readers of the parts skip _bad_rows/
    assert sorted(frame["a"].tolist()) == [1.0, 8.0, 10.0]


def test_an_extra_column_everywhere_fails_instead_of_shifting(tmp_path: Path) -> None:
    source = tmp_path / "wide.csv"
    source.write_text("a,b,label,extra\n1,2,0,5\n3,4,1,6\n")
    with pytest.raises(SourceError, match=r"wide\.csv: line 2: expected 3 fields, found 4"):
        fetch_sources(ingest_params(source, mode="files"), tmp_path / "raw")
    assert not list((tmp_path / "raw").glob("*.parquet"))


@pytest.mark.parametrize("mode", [{"mode": "files"}, {"block_size": 16}])
def test_an_empty_source_is_named(tmp_path: Path, mode: dict[str, object]) -> None:
    full, empty = tmp_path / "full.csv", tmp_path / "empty.csv"
    full.write_text("a,b,label\n1,2,0\n")
    empty.write_text("a,b,label\n")
    params = {**ingest_params(full, **mode), "sources": [str(full), str(empty)]}
    with pytest.raises(SourceError, match=r"'.*empty\.csv': .*holds no data rows \(after skip_rows: 1\)"):
        fetch_sources(params, tmp_path / "raw")


def test_on_bad_rows_takes_error_or_skip(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"on_bad_rows: one of error, skip, got 'drop'"):
        fetch_sources(ingest_params(tmp_path / "x.csv", on_bad_rows="drop"), tmp_path / "raw")


def test_the_reference_ingest_counts_bad_rows_in_its_metrics(bench: StageBench, tmp_path: Path) -> None:
    source = tmp_path / "dirty.csv"
    source.write_text(DIRTY)
    params = ingest_params(source, on_bad_rows="skip", mode="files")
    bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], metrics=["metrics/ingest.json"],
              overrides={"ingest": params})
    assert bench.json("metrics/ingest.json") == {"rows": 3, "bad_rows": 3, "parts": 1, "sources": 1,
                                                 "mb": round(len(DIRTY) / 1e6, 3), "retries": 0}
