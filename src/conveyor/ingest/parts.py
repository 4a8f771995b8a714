"""Parquet parts of an ingested dataset, each written whole or not at all.

A part is written to a hidden temporary sibling (``.part-00003.parquet.tmp``, which
pyarrow and dask skip when they read the directory) and renamed into place once
complete, so a failed or cancelled ingest never leaves a half-written part behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def part_path(out: Path, index: int, chunk: int | None = None) -> Path:
    """``part-00003.parquet``, or ``part-00003-0001.parquet`` for chunk 1 of unit 3.

    Lexicographic order (how pyarrow lists a directory) is (unit, chunk) order.
    """
    suffix = "" if chunk is None else f"-{chunk:04d}"
    return out / f"part-{index:05d}{suffix}.parquet"


def temporary(path: Path, tag: str = "tmp") -> Path:
    """A hidden sibling of ``path`` for work in progress."""
    return path.with_name(f".{path.name}.{tag}")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a hidden sibling, then rename it to ``path``; no leftovers on failure."""
    tmp = temporary(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
