"""Fetching many sources on a thread pool: fsspec URLs and globs, retries, checksums, byte ranges.

``fetch_sources(params, out, executor=ctx.executor, progress=ctx.progress, log=ctx.log)``
is what an ingest task calls; ``params`` is its section of params.yaml (see docs/how-to/ingest.md).
"""

from __future__ import annotations

from conveyor.ingest.fetch import Ingested, SourceError, fetch_sources

__all__ = ["Ingested", "SourceError", "fetch_sources"]
