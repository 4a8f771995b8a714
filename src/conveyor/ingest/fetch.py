"""Ingest: fetch every source on the stage's thread pool into parquet parts of one directory.

Sources (``ingest.sources``) are fsspec URLs or globs (``file://``, ``http(s)://``,
``s3://``...) read in one of two modes, or ``synthetic`` generators:

- ``blocks`` (the default when ``block_size`` is set): each file is cut into newline-aligned
  byte ranges, fetched and parsed independently, one part each; a failed range is
  re-read, not the file. For large single files.
- ``files``: each file is streamed into a hidden temporary file, checked against the size
  and md5 its source gives (``md5:`` in params, an S3 ETag, Content-MD5), then parsed
  into parts of ``rows_per_part`` rows on a pool of its own while the next transfers go
  on. For many files, and wherever checksums matter.
- ``{kind: synthetic, ...}``: HIGGS-shaped shards generated in parallel (:mod:`conveyor.ingest.synthetic`).

Transient failures (5xx, timeouts, dropped connections, damaged transfers) are retried
with exponential backoff (``ingest.retry``); permanent ones (404, 403, a bad CSV) fail at
once. Any failure fails the stage with the source's URL and the attempts it took; work not
yet started is cancelled, and no partial file stays behind. Part numbers follow (source,
file, offset), so the data set is the same however the threads race.

CSV is parsed strictly (:mod:`conveyor.ingest.rows`): a bad row fails the source naming
the file, line and column, or, with ``on_bad_rows: skip``, is left out and kept in
``<out>/_bad_rows/part-NNNNN.csv`` (a folder readers of the parquet parts skip).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from conveyor.errors import redact
from conveyor.ingest.meter import Meter
from conveyor.ingest.params import IngestParams, UrlSource
from conveyor.ingest.parts import part_path, temporary, write_atomically
from conveyor.ingest.retry import Cancelled, GaveUp, call_with_retries, describe
from conveyor.ingest.rows import BadRow, BadRowError, quarantine_csv, read_csv
from conveyor.ingest.sources import Announced, RemoteFile, data_start, download, expand_template, list_files, read_range
from conveyor.ingest.synthetic import SyntheticSource, write_shard
from conveyor.ingest.units import Block, Shard, Transfer, Unit
from conveyor.run.context import StageProgress

__all__ = ["Ingested", "SourceError", "expand_template", "fetch_sources"]

T = TypeVar("T")
BAD_ROWS = "_bad_rows"  # under the out: parquet readers (pyarrow, dask) skip names starting with _
_DEFAULT_WORKERS = 8
_WAIT_SLICE_S = 0.5
_MB = 1e6


class SourceError(OSError):
    """A source could not be listed, read or parsed; names the URL as written in params."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return redact(f"cannot ingest source '{self.url}': {self.reason}")


@dataclass(frozen=True)
class Ingested:
    """What :func:`fetch_sources` wrote."""

    rows: int
    parts: int
    sources: int
    bytes: int
    seconds: float
    retries: int
    bad_rows: int = 0  # left out (on_bad_rows: skip), each kept in <out>/_bad_rows/


def fetch_sources(params: Mapping[str, Any], out: Path, *, executor: Executor | None = None,
                  progress: StageProgress | None = None, log: logging.Logger | None = None,
                  key: str = "ingest") -> Ingested:
    """Fetch the sources ``params`` names into parquet parts in the new directory ``out``.

    ``params`` is an ingest section of params.yaml (``sources``, ``columns``, ``retry``...;
    see docs/how-to/ingest.md); ``key`` is its name there, used in error messages. Work runs on
    ``executor`` (the stage's thread pool) or on a pool of its own.
    """
    parsed = IngestParams.parse(params, key=key)
    log = log or logging.getLogger(__name__)
    out.mkdir(parents=True)
    started = time.monotonic()
    with _executor(executor) as pool:
        run = IngestRun(parsed, out, progress or StageProgress(), log)
        units = run.plan(pool)
        rows = run.execute(pool, units)
    if rows == 0:
        raise ValueError(f"{key}: the sources hold no data rows" + (f" ({run.bad_rows} bad rows left out, see "
                                                                    f"{out / BAD_ROWS})" if run.bad_rows else ""))
    done = Ingested(rows, len(units), len(parsed.sources), run.meter.bytes, time.monotonic() - started, run.retries,
                    run.bad_rows)
    log.info("ingested %d rows in %d parts from %d source(s): %.1f MB in %.1f s (%.1f MB/s), %d retries",
             done.rows, done.parts, done.sources, done.bytes / _MB, done.seconds,
             done.bytes / _MB / max(done.seconds, 1e-9), done.retries)
    if done.bad_rows:
        log.warning("left out %d bad rows (on_bad_rows: skip): each is in %s with its line and reason",
                    done.bad_rows, out / BAD_ROWS)
    return done


class IngestRun:
    """The state the workers of one ingest share: params, out dir, progress, cancellation."""

    def __init__(self, params: IngestParams, out: Path, progress: StageProgress, log: Any) -> None:
        self.params, self.out, self.log = params, out, log
        self.cancel = threading.Event()
        self.meter = Meter(progress)
        self.retries = 0
        self.bad_rows = 0
        self._lock = threading.Lock()

    # --- planning -------------------------------------------------------------------

    def plan(self, pool: Executor) -> list[Unit]:
        """Every unit of work in (source, file, offset) order; listings run on the pool."""
        urls = [s for s in self.params.sources if isinstance(s, UrlSource)]
        self.meter.planning(len(urls))
        listed = dict(zip(urls, run_all(pool, [self._lister(s) for s in urls], self.cancel), strict=True))
        blocky = [(s, f) for s in urls if s.mode == "blocks" for f in listed[s]]
        starts = run_all(pool, [self._starter(s, f) for s, f in blocky], self.cancel)
        offsets = dict(zip([f for _, f in blocky], starts, strict=True))
        units: list[Unit] = []
        for source in self.params.sources:
            if isinstance(source, SyntheticSource):
                units += [Shard(len(units) + i, source, i, source.shard_bytes(i)) for i in range(source.shards)]
            elif source.mode == "files":
                units += [Transfer(len(units) + i, f, f.size) for i, f in enumerate(listed[source])]
            else:
                for file in listed[source]:
                    units += self._blocks(len(units), file, offsets[file])
        self.meter.begin(units)
        return units

    def _lister(self, source: UrlSource) -> Callable[[], list[RemoteFile]]:
        def list_source() -> list[RemoteFile]:
            return self._retrying(source.url, source.url, lambda: list_files(
                source.url, self.params.access, md5=source.md5, sized=source.mode == "blocks"))
        return list_source

    def _starter(self, source: UrlSource, file: RemoteFile) -> Callable[[], int]:
        def find_start() -> int:
            if file.size is None:
                raise SourceError(source.url, f"{_where(file)}the size is unknown, which blocks mode needs; "
                                  "use mode: files for this source")
            skip = self.params.csv.skip_rows if self.params.csv else 0
            return self._retrying(file.url, file.location, lambda: data_start(file, skip))
        return find_start

    def _blocks(self, first: int, file: RemoteFile, start: int) -> list[Block]:
        """``block_size`` ranges for ``read_block``, which gives a block the lines that start
        in ``(offset, offset + length]`` (the first block also the line at 0): starting one
        byte before the first data line puts that line in the first block."""
        assert file.size is not None  # checked by _starter
        size, block_size = file.size, self.params.block_size
        if start >= size:
            raise SourceError(file.url, f"{_where(file)}holds no data rows (after skip_rows: "
                                        f"{self.params.csv.skip_rows if self.params.csv else 0})")
        offset0 = start - 1 if start > 0 else 0
        offsets = range(offset0, max(size, offset0 + 1), block_size)
        ends = [min(o + block_size, size) for o in offsets]
        return [Block(first + i, file, o, block_size, max(0, e - max(o, start))) for i, (o, e) in
                enumerate(zip(offsets, ends, strict=True))]

    # --- execution ------------------------------------------------------------------

    def execute(self, pool: Executor, units: Sequence[Unit]) -> int:
        """Run every unit on the pool; the total number of rows written.

        A whole-file transfer is parsed on a pool of its own (as many threads as cores, started
        only when a file arrives): the stage's pool thread goes on to the next transfer at once,
        so transfers keep waiting on the network while the files that arrived are parsed. At
        most twice the stage pool's size of arrived files wait for their parse (the disk they
        take is bounded).
        """
        waiting = threading.BoundedSemaphore(2 * getattr(pool, "_max_workers", _DEFAULT_WORKERS))
        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="ingest-parse") as parsers:
                return sum(run_all(pool, [self._runner(unit, parsers, waiting) for unit in units], self.cancel,
                                   self.meter.unit_done))
        finally:  # transfers that arrived but were never parsed (a failure elsewhere cancelled them)
            for unit in units:
                if isinstance(unit, Transfer):
                    self._download_path(unit).unlink(missing_ok=True)

    def _runner(self, unit: Unit, parsers: Executor,
                waiting: threading.BoundedSemaphore) -> Callable[[], int | Future[int]]:
        if isinstance(unit, Shard):
            return lambda: self._shard(unit)
        if isinstance(unit, Transfer):
            return lambda: self._transfer(unit, parsers, waiting)
        return lambda: self._block(unit)

    def _shard(self, unit: Shard) -> int:
        if self.cancel.is_set():
            raise Cancelled()
        rows = write_shard(unit.source, unit.shard, part_path(self.out, unit.index))
        self.meter.add_bytes(unit.nbytes)
        return rows

    def _block(self, block: Block) -> int:
        file = block.file
        data = self._retrying(file.url, file.location, lambda: read_range(file, block.offset, block.length))
        self.meter.add_bytes(len(data))
        if not data.strip():
            return 0
        where = f"{file.path} bytes {block.offset}+{block.length}"
        return self._write_parts(file, where, data, index=block.index, skip_rows=0, rows_per_part=None)

    def _download_path(self, unit: Transfer) -> Path:
        return temporary(part_path(self.out, unit.index).with_suffix(""), "download")  # .part-00003.download

    def _transfer(self, unit: Transfer, parsers: Executor, waiting: threading.BoundedSemaphore) -> Future[int]:
        """Download the file (retried as a whole), then hand it to ``parsers``: its rows, to come."""
        file, counted = unit.file, [0]
        dest = self._download_path(unit)

        def count(n: int) -> None:
            counted[0] += n
            self.meter.add_bytes(n)

        def attempt() -> Announced:
            self.meter.add_bytes(-counted[0])  # a retry starts from byte 0 again
            counted[0] = 0
            on_size = partial(self.meter.announce, unit) if unit.nbytes is None else None
            return download(file, dest, cancel=self.cancel, on_bytes=count, on_size=on_size)

        def parse() -> int:
            try:
                if self.cancel.is_set():
                    raise Cancelled()
                return self._write_parts(file, file.path, dest, index=unit.index, skip_rows=None,
                                         rows_per_part=self.params.rows_per_part)
            finally:
                dest.unlink(missing_ok=True)
                waiting.release()

        while not waiting.acquire(timeout=0.2):  # arrived files wait for their parse: this one waits to start
            if self.cancel.is_set():
                raise Cancelled()
        try:
            checked = self._retrying(file.url, file.location, attempt)
            self.log.debug("%s: %d bytes arrived; checked: size %s, md5 %s", file.location, counted[0],
                           checked.size is not None, checked.md5_from or "none given")
            return parsers.submit(parse)
        except BaseException:
            dest.unlink(missing_ok=True)
            waiting.release()
            raise

    def _write_parts(self, file: RemoteFile, where: str, src: Path | bytes, *, index: int,
                     skip_rows: int | None, rows_per_part: int | None) -> int:
        """Parse CSV rows into parts as they are read (``part-I`` for a block, ``part-I-K``
        per chunk of a file); a bad row, or a parse error, names the source and the place.
        Rows left out (``on_bad_rows: skip``) go to ``_bad_rows/part-I.csv``."""
        import pyarrow.parquet as pq

        csv = self.params.csv
        assert csv is not None  # URL sources always have CSV options
        rows, bad = 0, list[BadRow]()
        block = rows_per_part is None  # lines are counted from the block's start
        try:
            written: dict[int, int] = {}  # rows of each part (a second pass rewrites them)
            for chunk, table in read_csv(src, csv, skip_rows=csv.skip_rows if skip_rows is None else skip_rows,
                                         rows_per_part=rows_per_part, bad=bad):
                path = part_path(self.out, index, None if rows_per_part is None else chunk)
                write_atomically(path, partial(pq.write_table, table, write_page_checksum=True))
                written[chunk] = table.num_rows
            rows = sum(written.values())
        except BadRowError as exc:
            raise SourceError(file.url, f"{where}: {exc.message(block=block)}") from None
        except Exception as exc:
            raise SourceError(file.url, f"{where}: {type(exc).__name__}: {exc}") from exc
        if bad:
            folder = self.out / BAD_ROWS
            folder.mkdir(exist_ok=True)
            text = quarantine_csv(redact(file.url), where, sorted(bad, key=lambda row: row.line))
            write_atomically(folder / f"part-{index:05d}.csv", partial(Path.write_text, data=text, encoding="utf-8"))
            with self._lock:
                self.bad_rows += len(bad)
        elif rows == 0 and not block:
            raise SourceError(file.url, f"{where}: holds no data rows (after skip_rows: {csv.skip_rows})")
        return rows

    def _retrying(self, url: str, location: str, fn: Callable[[], T]) -> T:
        """``fn()`` with the retry policy; a failure for good becomes a :class:`SourceError`."""

        def on_retry(attempt: int, error: BaseException, delay: float) -> None:
            with self._lock:
                self.retries += 1
            self.log.warning("%s: attempt %d of %d failed (%s); retrying in %.2f s", location, attempt,
                             self.params.retry.attempts, describe(error), delay)

        try:
            return call_with_retries(fn, self.params.retry, cancel=self.cancel, on_retry=on_retry)
        except GaveUp as exc:
            where = "" if location == url else f"{location}: "
            raise SourceError(url, where + str(exc)) from exc.error


def run_all(pool: Executor, fns: Sequence[Callable[[], T | Future[T]]], cancel: threading.Event,
            on_done: Callable[[], None] | None = None) -> list[T]:
    """``[fn() for fn in fns]`` on the pool, results in order. A function may hand its work on:
    its result is then a future (of another pool), whose result is the function's.

    On the first failure the work not started is cancelled (the runner's pool is shared),
    the running work is told to stop and awaited (so it leaves no file behind), and the
    error propagates. On Ctrl-C nothing is awaited.
    """
    ended: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()
    futures: list[Future[Any]] = [pool.submit(fn) for fn in fns]
    slot = {future: k for k, future in enumerate(futures)}
    for future in futures:
        future.add_done_callback(ended.put)
    left = len(futures)
    try:
        while left:
            try:  # in slices: a timeout or Ctrl-C raised into this thread lands between them
                future = ended.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                continue
            left -= 1
            result = future.result()
            if isinstance(result, Future):  # handed on: its result, to come, is this one's
                slot[result] = k = slot[future]
                futures[k] = result
                left += 1
                result.add_done_callback(ended.put)
            elif on_done is not None:
                on_done()
    except BaseException as exc:
        cancel.set()
        for future in futures:
            future.cancel()
        if isinstance(exc, Exception):
            wait(futures)
        raise
    return [future.result() for future in futures]


def _where(file: RemoteFile) -> str:
    return "" if file.location == file.url else f"{file.location}: "


@contextmanager
def _executor(executor: Executor | None) -> Iterator[Executor]:
    """The stage's executor, or a private thread pool for the duration of the call."""
    if executor is not None:
        yield executor
        return
    with ThreadPoolExecutor(max_workers=_DEFAULT_WORKERS, thread_name_prefix="ingest") as pool:
        yield pool
