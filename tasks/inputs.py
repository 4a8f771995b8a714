"""The raw parts preprocess reads, and what can be wrong with them, named before any work.

A missing label, one class, a feature that is not a number, no parts, a part that does not
read, a part whose pages are damaged: each is a ValueError naming the data as the spec
declares it (``data/raw``) or the file, and what to do. The checks read metadata, or results
preprocess computes anyway; a broken part is looked for (its footer) only after a read failed.
Parts are read with their page checksums verified (:mod:`conveyor.parquet`): a page whose
bytes were damaged after it was written is an error naming its file, not wrong values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dask.dataframe as dd

    from conveyor import StageContext
    from conveyor.errors import DamagedFileError

_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")  # the parts dask's read_parquet reads
_SHOWN_COLUMNS = 20  # columns named in the error for a missing label


def declared(ctx: StageContext, path: Path) -> str:
    """The dep as the spec declares it (``data/raw``): what a user recognises in an error."""
    return next((declared for declared, dep in ctx.deps.items() if dep == path), str(path))


def read_parts(raw: Path, source: str, *, at_once_below: int = 0) -> dd.DataFrame:
    """The parquet parts under ``raw``, lazily; an empty directory is an error that says so.

    Parts holding fewer than ``at_once_below`` bytes in all are read now, in this process, as
    one partition: for data that small, a task per part and per step costs more than the work
    (569 rows in 12 parts: 1.3 s of dask scheduling against 0.2 s as one partition).
    dask's own error for no parts ("No files satisfy the `parquet_file_extension` criteria")
    names neither the directory nor the stage that should have filled it.
    """
    import dask.dataframe as dd

    from conveyor.parquet import read_dask, read_pandas

    parts = _parquet_parts(raw) if at_once_below else []
    if parts and sum(part.stat().st_size for part in parts) < at_once_below:
        import pandas as pd

        whole: dd.DataFrame = dd.from_pandas(pd.concat([read_pandas(part) for part in parts],
                                                       ignore_index=True), npartitions=1)
        return whole
    try:
        frame: dd.DataFrame = read_dask(raw)
    except ValueError as error:
        if raw.is_dir() and not _parquet_parts(raw):
            raise ValueError(f"preprocess: {source} holds no parquet parts: {_rerun(source)}") from error
        raise
    return frame


def uncompressed_bytes(raw: Path) -> int:
    """What the parts under ``raw`` hold uncompressed, from their footers: about their size in memory."""
    import pyarrow.parquet as pq

    total = 0
    for part in _parquet_parts(raw):
        footer = pq.read_metadata(part)
        total += sum(footer.row_group(i).total_byte_size for i in range(footer.num_row_groups))
    return total


@contextmanager
def naming_bad_parts(raw: Path, source: str) -> Iterator[None]:
    """Turn pyarrow's error about an unreadable part into one that names the part.

    ``read_parquet`` opens only the first part's footer; the others are opened by the
    tasks that read them, on the workers, and their ``ArrowInvalid`` ("Parquet magic bytes
    not found in footer") names no file. Only after such a failure are the footers of all
    the parts read, one small read per file, to find the culprit; the success path pays nothing.
    A part whose pages are damaged (footer intact) is named by the reader already.
    """
    import pyarrow as pa

    from conveyor.errors import DamagedFileError

    try:
        yield
    except DamagedFileError as error:
        raise ValueError(damaged_message("preprocess", error, raw, source, writer="ingest")) from error
    except pa.ArrowException as error:
        culprit = _unreadable_part(raw, source)
        if culprit is None:
            raise
        raise culprit from error


def _unreadable_part(raw: Path, source: str) -> ValueError | None:
    """The error naming the first part whose footer pyarrow cannot read; None if all read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in _parquet_parts(raw):
        try:
            pq.read_metadata(part)
        except (pa.ArrowException, OSError) as error:
            shown = f"{source}/{part.relative_to(raw).as_posix()}" if part != raw else source
            return ValueError(f"preprocess: {shown} is not a readable parquet file ({error}): {_rerun(source)}")
    return None


@contextmanager
def naming_damaged_files(reader: str, dep: Path, source: str, *, writer: str) -> Iterator[None]:
    """A file under the dep ``dep`` (declared as ``source``) whose pages are damaged, as the bad-data
    ValueError: ``<reader>: <the file> is damaged: <what>: <rerun its writer>``."""
    from conveyor.errors import DamagedFileError

    try:
        yield
    except DamagedFileError as error:
        raise ValueError(damaged_message(reader, error, dep, source, writer=writer)) from error


def damaged_message(reader: str, error: DamagedFileError, dep: Path, source: str, *, writer: str) -> str:
    """The file as declared (``data/raw/part-00001.parquet``), what is wrong with it, and what to do.

    ``--force``: if the file was damaged before its stage's run was recorded, the record holds
    the damaged bytes, and the stage counts as up to date.
    """
    return (f"{reader}: {_shown(Path(error.path), dep, source)} is damaged: {error.reason}: "
            f"rerun the stage that writes {source} (conveyor run --force {writer})")


def _shown(path: Path, dep: Path, source: str) -> str:
    """``path`` under the declared ``source`` when it lies below ``dep``, else as it is."""
    try:
        below = path.resolve().relative_to(dep.resolve())
    except ValueError:
        return str(path)
    return f"{source}/{below.as_posix()}" if below.parts else source


def _parquet_parts(raw: Path) -> list[Path]:
    """The files dask reads for ``raw``: itself if a file, else the ``*.parquet`` (``.parq``,
    ``.pq``) files below it, less the hidden and ``_``-prefixed ones pyarrow skips."""
    if raw.is_file():
        return [raw]
    return sorted(
        path
        for path in raw.rglob("*")
        if path.suffix in _PARQUET_SUFFIXES
        and path.is_file()
        and not any(part.startswith((".", "_")) for part in path.relative_to(raw).parts)
    )


def _rerun(source: str) -> str:
    """What to do about missing or broken parts: write them again."""
    return f"rerun the stage that writes {source} (conveyor run ingest)"


def check_columns(frame: dd.DataFrame, label: str, source: str) -> None:
    """The label is a column and every other column is numeric: from metadata, no data read.

    Without this, a missing label is a ``KeyError`` deep in ``dropna`` and a string feature
    fails in the middle of the statistics, after the split has already read every part.
    """
    import pandas as pd

    columns = [str(column) for column in frame.columns]
    if label not in columns:
        shown = ", ".join(columns[:_SHOWN_COLUMNS])
        if len(columns) > _SHOWN_COLUMNS:
            shown += f", ... ({len(columns)} in all)"
        raise ValueError(
            f"preprocess: label column '{label}' is not in {source} (columns: {shown or 'none'}): "
            f"set preprocess.label to one of them"
        )
    for column, dtype in frame.dtypes.items():
        if column != label and not pd.api.types.is_numeric_dtype(dtype):
            raise ValueError(
                f"preprocess: column '{column}' of {source} is {dtype}, not numeric: features are "
                f"standardised, so give it a numeric dtype when ingesting (ingest.dtype) or drop it"
            )


def check_classes(classes: list[Any], label: str, source: str) -> None:
    """At least two classes among the labelled rows (the classes the split's histogram counted).

    One class would give a model that cannot be trained (or one that is always right);
    no labelled row would give empty splits. Both would otherwise fail late, or not at all.
    """
    if len(classes) == 0:
        raise ValueError(
            f"preprocess: no row of {source} has a label '{label}' (the column is empty or all missing): "
            f"check the data ingest reads, or set preprocess.label to the column that holds the classes"
        )
    if len(classes) == 1:
        raise ValueError(
            f"preprocess: label '{label}' has one class ({classes[0]}) in {source}: "
            f"a classifier needs at least two"
        )
