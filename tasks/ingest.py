"""Ingest: the sources in params (``ingest.sources``) fetched on the stage's thread pool."""

from __future__ import annotations

from conveyor.ingest.fetch import fetch

__all__ = ["fetch"]
