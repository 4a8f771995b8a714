"""The ``ingest`` params, checked as a whole: every problem is reported at once.

```yaml
ingest:
  sources:                       # a URL, or a list of URLs / mappings
    - "s3://bucket/raw/*.csv"                        # a glob
    - {url: "https://host/a.csv", md5: "9e107d9d372bb6826bd81d3542a419d6"}
    - {kind: synthetic, rows: 2000000, shards: 16, seed: 42}
  columns: [...]                 # CSV: column names (required for URL sources)
  dtype: float64                 # CSV: one dtype, or {column: dtype}
  skip_rows: 1                   # CSV: header lines to skip in every file
  on_bad_rows: error             # CSV: error | skip (left out, kept in <out>/_bad_rows/)
  block_size: 10000              # bytes per block; sets the default mode to `blocks`
  mode: files                    # blocks | files (default: blocks if block_size is set)
  rows_per_part: 1000000         # files mode: rows per parquet part
  retry: {attempts: 5, initial_delay_s: 0.5, max_delay_s: 30, multiplier: 2, jitter: 0.5}
  timeout_s: 60                  # connect / read timeout of one request
  verify_etag: true              # check single-part S3 objects against their ETag (md5)
  storage_options:               # fsspec options per protocol
    s3: {client_kwargs: {endpoint_url: "http://127.0.0.1:9000"}}
```
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.ingest.retry import RetryPolicy
from conveyor.ingest.sources import Access
from conveyor.ingest.synthetic import SyntheticSource

MODES = ("blocks", "files")
KEYS = frozenset({"sources", "format", "columns", "dtype", "skip_rows", "on_bad_rows", "block_size", "mode",
                  "rows_per_part", "retry", "timeout_s", "verify_etag", "storage_options"})
ON_BAD_ROWS = ("error", "skip")
_URL_KEYS = frozenset({"kind", "url", "md5", "mode"})
_MD5 = re.compile(r"[0-9a-fA-F]{32}")


@dataclass(frozen=True)
class CsvOptions:
    """How to parse CSV: the ``ingest`` params that concern parsing."""

    columns: list[str]
    dtype: str | dict[str, str] | None
    skip_rows: int
    on_bad_rows: str = "error"  # a row of the wrong shape or with a value its dtype cannot hold


@dataclass(frozen=True)
class UrlSource:
    """One URL or glob of ``ingest.sources``, and how to read it."""

    url: str
    md5: str | None
    mode: str


@dataclass(frozen=True)
class IngestParams:
    """Everything ``fetch`` reads from params, checked."""

    sources: tuple[UrlSource | SyntheticSource, ...]
    csv: CsvOptions | None
    block_size: int
    rows_per_part: int
    retry: RetryPolicy
    access: Access

    @classmethod
    def parse(cls, params: Mapping[str, Any], *, key: str = "ingest") -> IngestParams:
        """Check ``params`` (the section named ``key``); a ValueError lists every problem."""
        problems: list[str] = []

        def check(fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
                return None

        unknown = sorted(set(params) - KEYS)
        if unknown:
            problems.append(f"unknown keys {unknown} (known: {', '.join(sorted(KEYS))})")
        if params.get("format", "csv") != "csv":
            problems.append(f"format: only 'csv' is supported, got {params['format']!r}")
        block_size = int(params.get("block_size") or 0)
        mode = str(params.get("mode", "blocks" if block_size else "files"))
        if mode not in MODES:
            problems.append(f"mode: one of {', '.join(MODES)}, got {mode!r}")
            mode = "files"
        sources = [check(_source, entry, i, mode, block_size) for i, entry in enumerate(_entries(params, problems))]
        has_urls = any(isinstance(s, UrlSource) for s in sources)
        csv = check(_csv_options, params) if has_urls else None
        rows_per_part = int(params.get("rows_per_part", 1_000_000))
        if rows_per_part < 1:
            problems.append(f"rows_per_part must be >= 1, got {rows_per_part}")
        retry = check(RetryPolicy.from_params, params.get("retry"))
        access = check(_access, params)
        if problems:
            lines = "\n".join(f"  {key}: {problem}" for problem in problems)
            raise ValueError(f"{len(problems)} problem(s) in the {key} params:\n{lines}")
        return cls(tuple(sources), csv, block_size, rows_per_part, retry, access)


def _entries(params: Mapping[str, Any], problems: list[str]) -> list[Any]:
    sources = params.get("sources")
    entries = [sources] if isinstance(sources, (str, Mapping)) else list(sources or [])
    if not entries:
        problems.append("sources: name at least one source")
    return entries


def _source(entry: Any, i: int, mode: str, block_size: int) -> UrlSource | SyntheticSource:
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, Mapping):
        raise ValueError(f"sources.{i}: a URL or a mapping, got {entry!r}")
    kind = entry.get("kind", "url")
    if kind == "synthetic":
        try:
            return SyntheticSource.from_params(entry)
        except ValueError as exc:
            raise ValueError(f"sources.{i}: {exc}") from exc
    if kind != "url":
        raise ValueError(f"sources.{i}.kind: 'url' or 'synthetic', got {kind!r}")
    unknown = sorted(set(entry) - _URL_KEYS)
    if unknown or "url" not in entry:
        raise ValueError(f"sources.{i}: a URL source has 'url' and optionally md5, mode (got {sorted(entry)})")
    md5 = entry.get("md5")
    if md5 is not None and not _MD5.fullmatch(str(md5)):
        raise ValueError(f"sources.{i}.md5: 32 hex digits, got {md5!r}")
    # A checksum covers a whole file, so a source with one is always transferred whole.
    chosen = str(entry.get("mode", "files" if md5 else mode))
    if chosen not in MODES:
        raise ValueError(f"sources.{i}.mode: one of {', '.join(MODES)}, got {chosen!r}")
    if chosen == "blocks" and md5:
        raise ValueError(f"sources.{i}: md5 needs mode: files (a checksum covers the whole file)")
    if chosen == "blocks" and block_size < 1:
        raise ValueError(f"sources.{i}: mode blocks needs block_size >= 1")
    return UrlSource(str(entry["url"]), str(md5).lower() if md5 else None, chosen)


def _csv_options(params: Mapping[str, Any]) -> CsvOptions:
    if not params.get("columns"):
        raise ValueError("columns: URL sources need the CSV column names")
    on_bad_rows = str(params.get("on_bad_rows", "error"))
    if on_bad_rows not in ON_BAD_ROWS:
        raise ValueError(f"on_bad_rows: one of {', '.join(ON_BAD_ROWS)}, got {on_bad_rows!r}")
    return CsvOptions(columns=[str(c) for c in params["columns"]], dtype=params.get("dtype"),
                      skip_rows=int(params.get("skip_rows", 0)), on_bad_rows=on_bad_rows)


def _access(params: Mapping[str, Any]) -> Access:
    import fsspec

    options = params.get("storage_options") or {}
    if not isinstance(options, Mapping):
        raise ValueError("storage_options: a mapping of protocol to fsspec options")
    known = set(fsspec.available_protocols())
    wrong = sorted(str(k) for k, v in options.items() if k not in known or not isinstance(v, Mapping))
    if wrong:
        raise ValueError(f"storage_options is keyed by protocol (s3:, http:, ...), each a mapping of fsspec "
                         f"options; not a protocol or not a mapping: {wrong}")
    timeout = params.get("timeout_s", 60.0)
    return Access(storage_options={str(k): dict(v) for k, v in options.items()},
                  timeout_s=None if timeout is None else float(timeout),
                  verify_etag=bool(params.get("verify_etag", True)))
