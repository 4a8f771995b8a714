"""Parquet with page checksums: what conveyor and the reference tasks write carries a CRC per
page, and what a stage reads is verified against it.

A parquet file whose footer is intact but whose pages are damaged (bytes overwritten or lost
on a disk, in a copy or a transfer) reads without any error, as wrong values: the footer says
where the pages are, not what they held. Written with ``write_page_checksum=True`` (pyarrow's
``write_table`` and ``ParquetWriter``, pandas' and dask's ``to_parquet``), each page carries a
CRC-32 of its bytes; read with ``page_checksum_verification=True``, pyarrow checks it, and a
damaged page is an ``OSError`` that names no file. The readers here verify, and turn that
error into a :class:`~conveyor.errors.DamagedFileError` naming the file.

Pages written without a CRC (files written before conveyor wrote checksums, or by tools that
write none) are read as before: pyarrow verifies only the pages that carry one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import DamagedFileError

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd
    import pyarrow as pa

__all__ = ["DamagedFileError", "damaged", "is_damaged", "naming_damage", "read_dask", "read_pandas", "read_table",
           "reason"]

_CHECKSUM = "checksum verification failed"  # pyarrow: "could not verify page integrity, CRC checksum ..."
# what else pyarrow says of a page whose bytes are damaged (a CRC covers a page's data, not its
# header), or of pages without a CRC: a header that does not deserialize, data that does not decompress
_UNDECODABLE = ("Deserializing page header failed", "Corrupt snappy compressed data", "Unexpected end of stream")


def is_damaged(error: BaseException) -> bool:
    """Whether ``error`` is pyarrow's for a damaged page: a failed CRC, or a page that does not decode."""
    text = str(error)
    return isinstance(error, OSError) and (_CHECKSUM in text or any(marker in text for marker in _UNDECODABLE))


def reason(error: BaseException) -> str:
    """What is wrong with the file, for :class:`DamagedFileError`: in words, then pyarrow's."""
    said = " ".join(str(error).split())
    what = "a page fails its checksum" if _CHECKSUM in said else "a page does not decode"
    return f"{what} (pyarrow: {said})"


def damaged(path: str | Path, error: BaseException) -> DamagedFileError | None:
    """The error naming the damaged file of ``path``, when ``error`` is pyarrow's for a damaged page.

    ``path`` a file: that file. A directory (a dataset of parts): pyarrow's error names no part,
    so each part is read again, verified, and the first one that fails is named (this happens
    only after a read failed: a successful read pays nothing). None: not a damaged page.
    """
    if not is_damaged(error):
        return None
    local = Path(path)
    if local.is_dir():
        import pyarrow.parquet as pq

        for part in pq.ParquetDataset(local).files:  # the files pyarrow reads, in its order
            try:
                pq.ParquetFile(part, page_checksum_verification=True).read(use_threads=False)
            except OSError as part_error:
                if is_damaged(part_error):
                    return DamagedFileError(str(part), reason(part_error))
    return DamagedFileError(str(path), reason(error))


def read_table(path: str | Path, *, columns: Sequence[str] | None = None) -> pa.Table:
    """``pyarrow.parquet.read_table``, verifying page checksums; a damaged page names its file."""
    import pyarrow.parquet as pq

    with naming_damage(path):
        return pq.read_table(path, columns=list(columns) if columns is not None else None,
                             page_checksum_verification=True)


def read_pandas(path: str | Path, *, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """``pandas.read_parquet`` (a file or a directory of parts), verifying page checksums.

    pandas hands ``page_checksum_verification`` on to ``pyarrow.parquet.read_table``.
    """
    import pandas as pd

    with naming_damage(path):
        return pd.read_parquet(path, columns=list(columns) if columns is not None else None,
                               page_checksum_verification=True)


@contextmanager
def naming_damage(path: str | Path) -> Iterator[None]:
    """pyarrow's error for a damaged page of what is read from ``path`` as the
    :class:`DamagedFileError` naming the file (:func:`damaged`); other errors as they are."""
    try:
        yield
    except OSError as error:
        named = damaged(path, error)
        if named is None:
            raise
        raise named from error


def read_dask(path: str | Path, **options: Any) -> dd.DataFrame:
    """``dask.dataframe.read_parquet`` (its ``options``), verifying page checksums where the
    parts are read: on the workers, or in this process; a damaged page names its file.

    dask's pyarrow engine forwards no option to the ``ParquetFile`` it opens a part with, so
    the parts are read by :class:`conveyor.parquet.engine.VerifyingEngine`, the same engine
    but for verifying fragments.
    """
    import dask.dataframe as dd

    from conveyor.parquet.engine import VerifyingEngine, verifying_format

    dataset = {"format": verifying_format(), **options.pop("dataset", {})}
    frame: dd.DataFrame = dd.read_parquet(str(path), engine=VerifyingEngine, dataset=dataset, **options)
    return frame
