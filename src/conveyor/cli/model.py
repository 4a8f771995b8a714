"""``conveyor predict`` and ``conveyor serve-model``: a trained model, scored in batch or served."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from conveyor.cli import signals
from conveyor.cli.common import SpecOption, app, err, out, project_of
from conveyor.errors import UsageError


@app.command()
def predict(
    input_: Annotated[str, typer.Option("--input", "-i", metavar="URL", show_default=False,
                                        help="Parquet or CSV: a path, glob or fsspec URL (file, http, s3).")],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE.parquet", show_default=False,
                                         help="The parquet file of scores to write (replaced whole).")],
    model: Annotated[str, typer.Option("--model", "-m", metavar="champion|DIR",
                                       help="The registry's champion (else the latest run's model), or a "
                                            "directory holding the model's files at their project paths.")
                     ] = "champion",
    config: SpecOption = None,
    profile: Annotated[str | None, typer.Option("--profile", metavar="NAME",
                                                help="Score on this Dask profile of the spec instead of a swarm "
                                                     "started for the job.")] = None,
    workers: Annotated[int | None, typer.Option("--workers", min=1, metavar="N",
                                                help="Worker processes of the swarm (default: one per core, "
                                                     "at most 8).")] = None,
    memory_limit: Annotated[str | None, typer.Option("--memory-limit", metavar="SIZE",
                                                     help="Of each swarm worker (e.g. 2GiB).")] = None,
    id_column: Annotated[str | None, typer.Option("--id", metavar="COLUMN",
                                                  help="The input column copied beside each score (default: "
                                                       "the spec's model.id, else the row number).")] = None,
    allow_extra: Annotated[bool, typer.Option("--allow-extra",
                                              help="Ignore input columns the model does not read.")] = False,
    blocksize: Annotated[str, typer.Option("--partition-size", metavar="SIZE",
                                           help="Bytes of input per partition.")] = "64MiB",
) -> None:
    """Score a file in batch on a Dask cluster started for the job (or --profile), then release it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from conveyor.predict import batch
    from conveyor.run.profiles import Profiles

    project = project_of(config)
    if not _is_size(blocksize):
        raise UsageError(f"--partition-size {blocksize}: write a size like 64MiB")
    profiles, name = batch.options_of(project, profile, workers, memory_limit)
    job, frame = batch.plan(project, model, input_, output, id_column=id_column, allow_extra=allow_extra,
                            blocksize=blocksize)
    log = _job_log(project.root)
    try:
        try:
            with _captured(log) as terminal:
                bar = Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("partitions"),
                               TimeElapsedColumn(), console=terminal, transient=True)
                task = bar.add_task("scoring", total=None)
                with Profiles(profiles) as started, bar:
                    client = started.get(name).client
                    assert client is not None  # options_of refuses thread pools
                    scored = batch.run(job, frame, project.root, client, owned=name == batch.SWARM,
                                       progress=lambda done, total: bar.update(task, completed=done, total=total))
        finally:
            _point_at(log, project.root)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, a closed terminal: the cluster closed, the staging file gone
        signals.stopped(err, f"scoring stopped, the workers started for it too; {output} is as it was")
    out.print(batch.describe(scored), highlight=False, soft_wrap=True)


KEPT_LOGS = 20


def _job_log(root: Path) -> Path | None:
    """``.conveyor/predict/<UTC time>-<id>.log``, where Dask's messages of the job go (its workers
    paused, restarted at their memory limit, ...): the newest 20 jobs' are kept. None where the
    project cannot be written (a read-only checkout scores all the same, Dask's lines on stderr)."""
    import uuid
    from datetime import UTC, datetime

    from conveyor.workspace import state_dir

    try:
        folder = state_dir(root) / "predict"
        folder.mkdir(exist_ok=True)
        for old in sorted(folder.glob("*.log"))[:-(KEPT_LOGS - 1)]:
            old.unlink(missing_ok=True)
        path = folder / f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}.log"
        path.touch()
    except OSError:
        return None
    return path


@contextmanager
def _captured(log: Path | None) -> Iterator[Console]:
    """What the job's processes print (Dask's workers, the scorer, libraries) goes to ``log``; yields
    the terminal."""
    if log is None:
        yield err
        return
    from conveyor.run.capture import capture_output

    with capture_output(log) as terminal:
        yield terminal


def _point_at(log: Path | None, root: Path) -> None:
    """One line naming the job's log where something was said there; an empty one is removed."""
    if log is None:
        return
    try:
        lines = len(log.read_text(encoding="utf-8", errors="replace").splitlines())
        if not lines:
            log.unlink()
            return
    except OSError:
        return
    err.print(f"the job's log: {log.relative_to(root)} ({lines} line{'s' if lines > 1 else ''} from Dask and "
              "the scorer)", style="dim", highlight=False, soft_wrap=True)


def _is_size(text: str) -> bool:
    from conveyor.spec.base import BYTES

    return bool(BYTES.match(text))


@app.command("serve-model")
def serve_model(
    model: Annotated[str, typer.Option("--model", "-m", metavar="champion|DIR",
                                       help="The registry's champion, followed as it changes (else the latest "
                                            "run's model), or a directory holding the model's files.")
                     ] = "champion",
    config: SpecOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one, printed).")] = 8000,
    max_rows: Annotated[int, typer.Option("--max-rows", min=1, help="Rows per request at most.")] = 10_000,
    max_body: Annotated[str, typer.Option("--max-body", metavar="SIZE", help="Request body size at most.")
                        ] = "16MiB",
    log_level: Annotated[str, typer.Option("--log-level", metavar="LEVEL",
                                           help="The HTTP server's: warning (default), info (a line per "
                                                "request), debug, error, critical.")] = "warning",
) -> None:
    """Serve the model over HTTP (POST /predict, GET /model, GET /health, OpenAPI at /docs) until Ctrl-C."""
    from conveyor.predict.service import LOG_LEVELS, serve

    if not _is_size(max_body):
        raise UsageError(f"--max-body {max_body}: write a size like 16MiB")
    if log_level.lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level {log_level}: one of {', '.join(LOG_LEVELS)}")
    try:
        serve(project_of(config), model, host=host, port=port, max_rows=max_rows, max_body=max_body,
              log_level=log_level.lower())
    except KeyboardInterrupt:  # uvicorn has shut down gracefully, then re-raised the signal
        signals.stopped(err, "the model service stopped")
