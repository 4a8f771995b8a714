"""Ingest: the sources in params (``ingest.sources``) fetched on the stage's thread pool into parquet parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.ingest import fetch_sources

if TYPE_CHECKING:
    from conveyor import StageContext


def fetch(ctx: StageContext) -> None:
    """Fetch the declared ``ingest`` params (or ``<anything>.ingest``) into the stage's one out."""
    key = ctx.section_key("ingest")
    fetch_sources(ctx.params[key], ctx.out(), executor=ctx.executor, progress=ctx.progress, log=ctx.log, key=key)
