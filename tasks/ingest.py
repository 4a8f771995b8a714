"""Ingest: the sources in params (``ingest.sources``) fetched on the stage's thread pool into parquet parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.ingest import fetch_sources
from tasks.files import write_json

if TYPE_CHECKING:
    from conveyor import StageContext


def fetch(ctx: StageContext) -> None:
    """Fetch the declared ``ingest`` params (or ``<anything>.ingest``) into the stage's one out.

    A stage that declares a metrics file gets what arrived in it (rows, rows left out by
    ``on_bad_rows: skip``, parts, MB, retries): the run summary and ``dvc metrics show`` list them.
    """
    key = ctx.section_key("ingest")
    done = fetch_sources(ctx.params[key], ctx.out(), executor=ctx.executor, progress=ctx.progress, log=ctx.log,
                         key=key)
    if ctx.metrics:
        write_json(ctx.metric(), {"rows": done.rows, "bad_rows": done.bad_rows, "parts": done.parts,
                                  "sources": done.sources, "mb": round(done.bytes / 1e6, 3),
                                  "retries": done.retries})
