"""CSV rows into Arrow tables, strictly: a row with too few or too many fields, or a value its
column's dtype cannot hold, is a bad row, never padded, shifted or guessed.

pandas' parser pads a short row with NaN and, when every row has one field more than the
names, silently makes the first field the index (every column shifted by one). Arrow's
parser (``pyarrow.csv``) checks the field count of every row and numbers the rows, so a bad
row can be named by its line. ``ingest.on_bad_rows`` says what a bad row does:

- ``error`` (the default): the source fails, naming the file, the line and the column;
- ``skip``: the row is left out and kept, with its line and reason, for a quarantine file.

Values are converted by Arrow to the declared dtype; where that fails (a word in a float
column) the block is read again as text and each value checked, which finds every bad row
and its column. Clean data never takes that path. Numbers and booleans stay in Arrow from
the parser to the parquet writer; other dtypes (``string``, ``category``, nullable ``Int64``,
inferred ones) are converted by pandas. Either way a table carries the pandas metadata that
``DataFrame.to_parquet(index=False)`` would write, so the parts are the same bytes.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.ingest.params import CsvOptions

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

_READ_BLOCK = 1 << 22  # bytes Arrow parses at a time when streaming a file
# Arrow's conversion error: "In CSV column #1: Row #1701: CSV conversion error to double: invalid value 'x'"
_CONVERSION = re.compile(r"In CSV column #(?P<column>\d+): Row #(?P<row>\d+): CSV conversion error to "
                         r"(?P<type>\w+): invalid value (?P<value>.*)$")


@dataclass(frozen=True)
class BadRow:
    """A row left out: its line (1-based, in the file or in the block read), why, and its text."""

    line: int
    reason: str
    text: str
    column: str | None = None


class BadRowError(ValueError):
    """A bad row where ``on_bad_rows`` is ``error``."""

    def __init__(self, row: BadRow) -> None:
        super().__init__(row)
        self.row = row

    def __str__(self) -> str:
        return self.message()

    def message(self, *, block: bool = False) -> str:
        """``block``: the line is counted from the start of a block read, not of the file."""
        line = f"line {self.row.line}" + (" of the block" if block else "")
        column = f", column '{self.row.column}'" if self.row.column else ""
        return (f"{line}{column}: {self.row.reason} (set on_bad_rows: skip in the ingest params to leave such "
                "rows out and keep them in a quarantine file)")


class _Unconvertible(Exception):
    """Arrow could not convert a value: read the block again as text to find every bad one."""

    def __init__(self, row: BadRow | None) -> None:
        super().__init__(row)
        self.row = row


def read_csv(src: Path | bytes, options: CsvOptions, *, skip_rows: int, rows_per_part: int | None,
             bad: list[BadRow]) -> Iterator[tuple[int, pa.Table]]:
    """The rows of ``src`` as numbered tables of ``rows_per_part`` rows (None: one table); the
    rows left out are appended to ``bad``. Raises :class:`BadRowError` at the first bad row when
    ``options.on_bad_rows`` is ``error``.

    A number may come again, after a value Arrow could not convert: the second pass over
    ``src`` yields every table again, and a later table replaces the earlier one of its number.
    """
    start = len(bad)
    try:
        try:  # the rows before the first value Arrow cannot convert are clean: a second pass yields them again
            yield from enumerate(_frames(src, options, skip_rows, rows_per_part, bad, typed=True))
            return
        except _Unconvertible as exc:
            if options.on_bad_rows == "error" and exc.row is not None:
                raise BadRowError(exc.row) from None
        del bad[start:]
        yield from enumerate(_frames(src, options, skip_rows, rows_per_part, bad, typed=False))
    except BadRowError as exc:
        raise BadRowError(_renumber(src, [exc.row])[0]) from None
    finally:
        bad[start:] = _renumber(src, bad[start:])


def _renumber(src: Path | bytes, rows: list[BadRow]) -> list[BadRow]:
    """``rows`` numbered by the lines of ``src``: Arrow numbers rows, and does not count empty
    lines. Read again only when there are bad rows."""
    wanted = sorted({row.line for row in rows})
    if not wanted:
        return rows
    lines: dict[int, int] = {}
    number = 0
    with io.BytesIO(src) if isinstance(src, bytes) else src.open("rb") as text:
        for line_number, line in enumerate(text, 1):
            if line.rstrip(b"\r\n"):
                number += 1
                if number == wanted[len(lines)]:
                    lines[number] = line_number
                    if len(lines) == len(wanted):
                        break
    return [replace(row, line=lines.get(row.line, row.line)) for row in rows]


def _frames(src: Path | bytes, options: CsvOptions, skip_rows: int, rows_per_part: int | None,
            bad: list[BadRow], *, typed: bool) -> Iterator[pa.Table]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    wrong_shape: list[BadRow] = []
    skipped: list[int] = []  # lines Arrow returns no row for

    def on_invalid(row: Any) -> str:  # pyarrow.csv.InvalidRow: a row whose field count is wrong
        skipped.append(int(row.number))
        if not row.text.strip():
            return "skip"  # only white space: a blank line
        wrong_shape.append(BadRow(int(row.number), f"expected {row.expected_columns} fields, found "
                                                   f"{row.actual_columns}", str(row.text)))
        return "error" if options.on_bad_rows == "error" else "skip"

    types = {c: t for c in options.columns if (t := _arrow_type(options, c)) is not None} if typed else \
        {c: pa.string() for c in options.columns}
    lines = _LineCounter(skip_rows)
    # every column a number or boolean Arrow converts to itself: pandas would only add its metadata
    native = typed and len(types) == len(options.columns) and not any(map(pa.types.is_string, types.values()))
    held: list[pa.Table] = []
    count = 0
    try:  # Arrow reads (and converts) the first block when the reader opens
        reader = pacsv.open_csv(
            pa.BufferReader(src) if isinstance(src, bytes) else pa.OSFile(str(src)),
            read_options=pacsv.ReadOptions(column_names=options.columns, skip_rows=skip_rows, use_threads=False,
                                           block_size=_READ_BLOCK),
            parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid),
            convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True,
                                                 quoted_strings_can_be_null=True),
        )
        for batch in reader:
            numbers = lines.advance(batch.num_rows, skipped)
            skipped.clear()
            bad.extend(wrong_shape)
            wrong_shape.clear()
            if native and not _nulls_to_cast(batch):
                table = pa.Table.from_batches([batch]).replace_schema_metadata(_pandas_metadata(batch.schema))
            else:
                frame = batch.to_pandas()
                frame = _cast(frame, options) if typed else _convert(frame, options, numbers, bad)
                table = pa.Table.from_pandas(frame, preserve_index=False)
            held.append(table)
            count += table.num_rows
            while rows_per_part is not None and count >= rows_per_part:
                chunk, held, count = _take(held, rows_per_part)
                yield chunk
    except pa.ArrowInvalid as exc:
        if wrong_shape and options.on_bad_rows == "error":
            raise BadRowError(wrong_shape[0]) from None
        found = _CONVERSION.search(str(exc))
        if typed and found:
            column = options.columns[int(found["column"])]
            row = BadRow(int(found["row"]), f"{found['value']} cannot be read as "
                                            f"{_dtype(options, column) or found['type']}", "", column)
            raise _Unconvertible(row) from None
        raise
    bad.extend(wrong_shape)  # rows of the last block, if Arrow reported them after its last batch
    if held and count:
        yield pa.concat_tables(held).combine_chunks()


class _LineCounter:
    """Arrow's number of each row it returns: the rows it skipped (wrong shape) are gaps.

    Arrow may parse a block ahead of the batch it returns, so gaps past the batch wait here.
    """

    def __init__(self, skip_rows: int) -> None:
        self.next = skip_rows + 1
        self.gaps: list[int] = []

    def advance(self, n_rows: int, skipped: list[int]) -> list[int]:
        gaps, i = sorted([*self.gaps, *skipped]), 0
        numbers: list[int] = []
        line = self.next
        while len(numbers) < n_rows:
            if i < len(gaps) and gaps[i] == line:
                i += 1
            else:
                numbers.append(line)
            line += 1
        self.next, self.gaps = line, gaps[i:]
        return numbers


def _take(held: list[pa.Table], n: int) -> tuple[pa.Table, list[pa.Table], int]:
    import pyarrow as pa

    whole = pa.concat_tables(held).combine_chunks()
    return whole.slice(0, n), [whole.slice(n)], whole.num_rows - n


def _nulls_to_cast(batch: pa.RecordBatch) -> bool:
    """Whether a column other than a float one has a missing value: pandas decides what becomes of it
    (an int column cannot hold one)."""
    import pyarrow.types as types

    return any(column.null_count and not types.is_floating(column.type) for column in batch.columns)


@functools.lru_cache(maxsize=16)
def _pandas_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """The schema metadata ``pa.Table.from_pandas(frame, preserve_index=False)`` gives a frame of ``schema``."""
    import pyarrow as pa

    metadata = pa.Table.from_pandas(schema.empty_table().to_pandas(), preserve_index=False).schema.metadata
    return dict(metadata or {})


def _dtype(options: CsvOptions, column: str) -> Any:
    return options.dtype.get(column) if isinstance(options.dtype, dict) else options.dtype


def _arrow_type(options: CsvOptions, column: str) -> pa.DataType | None:
    """The Arrow type Arrow can convert ``column`` to directly (numbers, booleans); None: as text,
    converted by pandas after (``string``, ``category``, nullable ``Int64``, ...) or inferred."""
    import numpy as np
    import pyarrow as pa

    dtype = _dtype(options, column)
    if dtype is None:
        return None
    try:
        numpy_type = np.dtype(dtype)
    except TypeError:
        return pa.string()
    return pa.from_numpy_dtype(numpy_type) if numpy_type.kind in "fiub" else pa.string()


def _cast(frame: pd.DataFrame, options: CsvOptions) -> pd.DataFrame:
    """The declared dtypes, where Arrow's conversion left another one (an int column with a missing value)."""
    for column in frame.columns:
        dtype = _dtype(options, column)
        if dtype is not None and str(frame[column].dtype) != str(dtype):
            try:
                frame[column] = frame[column].astype(dtype)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"column '{column}': {exc}") from exc
    return frame


def _convert(frame: pd.DataFrame, options: CsvOptions, lines: list[int], bad: list[BadRow]) -> pd.DataFrame:
    """Text columns to their declared dtypes, value by value: the rows holding a value that does
    not convert are bad (the first one raised, or all of them left out)."""
    import numpy as np
    import pandas as pd

    wrong = np.zeros(len(frame), dtype=bool)
    reasons: dict[int, tuple[str, str]] = {}
    converted: dict[str, Any] = {}
    for column in frame.columns:
        dtype = _dtype(options, column)
        kind = _numeric_kind(dtype)
        if kind is None:
            continue
        text = frame[column]
        values = pd.to_numeric(text, errors="coerce")
        failed = text.notna().to_numpy() & values.isna().to_numpy()
        if kind in "iu":
            failed |= values.notna().to_numpy() & (values.to_numpy() % 1 != 0)
        for i in np.flatnonzero(failed & ~wrong):
            reasons[int(i)] = (column, f"{text.iloc[i]!r} cannot be read as {dtype}")
        wrong |= failed
        converted[column] = values
    if wrong.any():
        rows = [BadRow(lines[i], reasons[i][1], ",".join("" if v is None else str(v) for v in frame.iloc[i]),
                       reasons[i][0]) for i in map(int, np.flatnonzero(wrong))]
        if options.on_bad_rows == "error":
            raise BadRowError(rows[0])
        bad.extend(rows)
    for column, values in converted.items():
        frame[column] = values
    frame = frame[~wrong]
    return _cast(frame, options)


def _numeric_kind(dtype: Any) -> str | None:
    import numpy as np

    if dtype is None:
        return None
    try:
        kind: str = np.dtype(dtype).kind
    except TypeError:
        return None
    return kind if kind in "fiu" else None


def quarantine_csv(source: str, where: str, rows: list[BadRow]) -> str:
    """``rows`` as the CSV text of a quarantine file: source, where, line, column, reason, text."""
    import csv

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["source", "where", "line", "column", "reason", "text"])
    for row in rows:
        writer.writerow([source, where, row.line, row.column or "", row.reason, row.text])
    return buffer.getvalue()
