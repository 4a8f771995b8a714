"""dask's pyarrow parquet engine, reading every part with its page checksums verified.

dask's ``ArrowDatasetEngine`` reads a part from its path with a ``pyarrow.parquet.ParquetFile``
it opens itself (no option of ``read_parquet`` reaches it), and reads a part as a dataset
fragment only to filter rows or to discover hive partitions. This engine hands dask a
fragment of a verifying :class:`pyarrow.dataset.ParquetFileFormat` instead of the path; where
dask makes the fragment itself, it makes it with the format of the ``dataset`` options, which
:func:`conveyor.parquet.read_dask` sets to the same. A damaged page becomes a
:class:`~conveyor.errors.DamagedFileError` naming the part, raised where the part is read (on
a worker, it reaches the client as it is).

A module of its own, imported where parquet is read: it imports dask and pyarrow.
"""

from __future__ import annotations

from typing import Any

import pyarrow.dataset as pa_ds
import pyarrow.fs as pa_fs
from dask.dataframe.io.parquet.arrow import ArrowDatasetEngine

from conveyor.errors import DamagedFileError


def verifying_format() -> pa_ds.ParquetFileFormat:
    """Parquet whose pages' CRCs are checked as they are read (pages without one are read as they are)."""
    return pa_ds.ParquetFileFormat(
        default_fragment_scan_options=pa_ds.ParquetFragmentScanOptions(page_checksum_verification=True))


class VerifyingEngine(ArrowDatasetEngine):
    """``engine=`` for ``dask.dataframe.read_parquet``: pyarrow's, verifying page checksums."""

    @classmethod
    def _read_table(cls, path_or_frag: Any, fs: Any, row_groups: Any, columns: Any, schema: Any, filters: Any,
                    partitions: Any, partition_keys: Any, **kwargs: Any) -> Any:
        path = path_or_frag if isinstance(path_or_frag, str) else str(path_or_frag.path)
        partitioning = kwargs.get("dataset", {}).get("partitioning")
        dask_makes_fragment = bool(partitions and partition_keys is None) or bool(
            partitioning and not isinstance(partitioning, (str, list)))
        if isinstance(path_or_frag, str) and not dask_makes_fragment:
            # the partition columns, if any, are added by dask afterwards from partition_keys
            path_or_frag = verifying_format().make_fragment(
                path_or_frag, filesystem=_arrow_filesystem(fs), row_groups=None if row_groups == [None] else row_groups)
        try:
            return super()._read_table(  # type: ignore[no-untyped-call]  # dask ships no type hints
                path_or_frag, fs, row_groups, columns, schema, filters, partitions, partition_keys, **kwargs)
        except OSError as error:
            from conveyor.parquet import is_damaged, reason

            if not is_damaged(error):
                raise
            raise DamagedFileError(path, reason(error)) from error


def _arrow_filesystem(fs: Any) -> pa_fs.FileSystem:
    """dask's filesystem (fsspec's, or pyarrow's wrapped for fsspec) as a pyarrow one."""
    from fsspec.implementations.arrow import ArrowFSWrapper
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, ArrowFSWrapper):
        inner: pa_fs.FileSystem = fs.fs
        return inner
    if isinstance(fs, pa_fs.FileSystem):
        return fs
    if isinstance(fs, LocalFileSystem):  # native reads, no Python in between
        return pa_fs.LocalFileSystem()
    return pa_fs.PyFileSystem(pa_fs.FSSpecHandler(fs))
