"""Ingest: fetch delimited text sources in byte ranges, concurrently, into parquet parts.

Each source file is cut into ``block_size`` byte ranges aligned on newlines (every line
lands in exactly one block), the blocks are fetched and parsed on the stage's thread
pool, and each non-empty block becomes ``part-NNNNN.parquet`` in ``data/raw``; part
numbers follow (source, file, offset), so the dataset is the same however threads race.
"""

from __future__ import annotations

import importlib.resources
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from flows.context import StageContext, StageProgress

_PACKAGE_TEMPLATE = re.compile(r"\{package:([A-Za-z_][\w.]*)\}")
_GLOB_CHARS = ("*", "?", "[")
_DEFAULT_WORKERS = 8


class SourceError(OSError):
    """A source could not be listed, read or parsed; names the URL as written in params."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot ingest source '{self.url}': {self.reason}"


@dataclass(frozen=True)
class Block:
    """One newline-aligned byte range of one source file, and where its rows go."""

    index: int
    url: str
    fs: AbstractFileSystem
    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class CsvOptions:
    """How to parse a block: the ``ingest`` params that concern parsing."""

    columns: list[str]
    dtype: str | dict[str, str] | None
    skip_rows: int


def fetch(ctx: StageContext) -> None:
    """Fetch every block of every source on the thread pool and write parquet parts."""
    params: Mapping[str, Any] = ctx.params["ingest"]
    if params.get("format", "csv") != "csv":
        raise ValueError(f"ingest.format: only 'csv' is supported, got {params['format']!r}")
    options = CsvOptions(
        columns=list(params["columns"]),
        dtype=params.get("dtype"),
        skip_rows=int(params.get("skip_rows", 0)),
    )
    sources = params["sources"]
    urls = [sources] if isinstance(sources, str) else list(sources)
    blocks = plan_blocks(urls, block_size=int(params["block_size"]), skip_rows=options.skip_rows)
    out = ctx.out("data/raw")
    out.mkdir(parents=True)
    ctx.progress.start(len(blocks), unit="blocks", description="fetching")
    with _executor(ctx.executor) as pool:
        futures = [pool.submit(_fetch_block, block, options, out) for block in blocks]
        rows = _collect(futures, ctx.progress)
    if rows == 0:
        raise ValueError(f"ingest: the sources {urls} hold no data rows")
    ctx.log.info("ingested %d rows from %d blocks of %d source(s)", rows, len(blocks), len(urls))


def _collect(futures: list[Future[int]], progress: StageProgress) -> int:
    """Total rows of the fetched blocks; on the first failure the blocks not started are
    cancelled (the runner's pool is shared) and the error, naming its source, propagates."""
    rows = 0
    try:
        for future in as_completed(futures):
            rows += future.result()
            progress.advance(1)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return rows


def plan_blocks(urls: Sequence[str], *, block_size: int, skip_rows: int) -> list[Block]:
    """Every block of every file the URLs name, in (source, file, offset) order."""
    if block_size < 1:
        raise ValueError(f"ingest.block_size must be >= 1, got {block_size}")
    blocks: list[Block] = []
    for url in urls:
        for fs, path in _expand(url):
            for offset in _offsets(url, fs, path, block_size, skip_rows):
                blocks.append(Block(len(blocks), url, fs, path, offset, block_size))
    return blocks


def expand_template(url: str) -> str:
    """Replace ``{package:NAME}`` with the directory of the installed package NAME."""
    return _PACKAGE_TEMPLATE.sub(lambda m: str(importlib.resources.files(m.group(1))), url)


def _expand(url: str) -> list[tuple[AbstractFileSystem, str]]:
    """The (filesystem, path) pairs a URL names: one file, or the sorted matches of a glob."""
    import fsspec.core

    try:
        fs, path = fsspec.core.url_to_fs(expand_template(url))
        if not any(char in path for char in _GLOB_CHARS):
            return [(fs, path)]
        matches = sorted(fs.glob(path))
    except Exception as exc:
        raise SourceError(url, f"{type(exc).__name__}: {exc}") from exc
    if not matches:
        raise SourceError(url, "no files match the pattern")
    return [(fs, match) for match in matches]


def _offsets(url: str, fs: AbstractFileSystem, path: str, block_size: int, skip_rows: int) -> range:
    """The offsets of the ``block_size`` blocks of one file, for ``fsspec.utils.read_block``.

    ``read_block`` gives a block the lines that start in ``(offset, offset + length]``
    (the first block also the line at 0), so starting one byte before the first data line
    (the newline that ends the skipped rows) puts that line in the first block.
    """
    try:
        size = int(fs.size(path))
        data_start = _skip_lines(fs, path, skip_rows)
    except Exception as exc:
        raise SourceError(url, f"{type(exc).__name__}: {exc}") from exc
    first = data_start - 1 if data_start > 0 else 0
    return range(first, max(size, first + 1), block_size)


def _skip_lines(fs: AbstractFileSystem, path: str, n: int) -> int:
    """The byte offset just past the first ``n`` lines of a file (the header rows)."""
    if n == 0:
        return 0
    with fs.open(path, "rb") as f:
        for _ in range(n):
            f.readline()
        return int(f.tell())


def _fetch_block(block: Block, options: CsvOptions, out: Path) -> int:
    """Read, parse and write one block; the number of rows it held (0: nothing written)."""
    import pandas as pd
    from fsspec.utils import read_block

    try:
        with block.fs.open(block.path, "rb") as f:
            data = read_block(f, block.offset, block.length, delimiter=b"\n")
        if not data.strip():
            return 0
        frame = pd.read_csv(io.BytesIO(data), header=None, names=options.columns, dtype=options.dtype)
    except Exception as exc:
        where = f"{block.path} bytes {block.offset}+{block.length}"
        raise SourceError(block.url, f"{where}: {type(exc).__name__}: {exc}") from exc
    frame.to_parquet(out / f"part-{block.index:05d}.parquet", index=False)
    return len(frame)


@contextmanager
def _executor(executor: Executor | None) -> Iterator[Executor]:
    """The stage's executor, or a private thread pool for the duration of the call."""
    if executor is not None:
        yield executor
        return
    with ThreadPoolExecutor(max_workers=_DEFAULT_WORKERS, thread_name_prefix="ingest") as pool:
        yield pool
