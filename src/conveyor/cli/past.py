"""``conveyor runs`` and ``conveyor compare``: the past runs of a spec, from their run records."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from conveyor.cli.common import SpecOption, app, err, out, place_of
from conveyor.cli.server import kept_line
from conveyor.errors import UsageError

if TYPE_CHECKING:
    from rich.table import Table

    from conveyor.run.record import RunRecord
    from conveyor.spec.project import Place


@app.command()
def runs(
    config: SpecOption = None,
    last: Annotated[int, typer.Option("--last", "-n", metavar="N", min=1, help="How many runs to list.")] = 10,
) -> None:
    """List the past runs of the spec, newest first: status, wall time, stages ran/skipped/failed, -S."""
    from conveyor.cli.history import runs_table

    project, _, found, _ = _past_runs(config)
    if not found:
        out.print(f"no runs of {project.rel(project.spec_path)} yet (`conveyor run{project.spec_option}` makes one)",
                  highlight=False)
        return
    _print_whole(runs_table(found[::-1][:last]))
    with contextlib.suppress(OSError):  # a PREFECT_HOME this user cannot write: the line is left out
        if (line := kept_line()) is not None:
            out.print(line, highlight=False, soft_wrap=True)


@app.command()
def compare(
    run_ids: Annotated[list[str] | None, typer.Argument(metavar="RUN", hidden=True)] = None,
    config: SpecOption = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.html", help="Also write an HTML page with a chart per metric (no network needed).")
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Every param, also those the same in every row.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The rows as JSON, every param, values unfolded.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="The rows as CSV, every param, values unfolded.")] = False,
) -> None:
    """Params and metrics of runs side by side, matrix items on rows of their own (as dvc exp show).

    Shows the params that differ between the rows (bold where one changed since the run before)
    and every metric; --all shows every param.

    RUN...: run ids or unique prefixes of them, shown in that order (default: the last 5 runs, oldest first).
    """
    from conveyor.cli.history import compare_table, pick
    from conveyor.run.compare import rows_of

    if as_json and as_csv:
        raise UsageError("--json and --csv: give one of them")
    page = _plot_path(plot) if plot is not None else None
    project, name, mine, others = _past_runs(config)
    chosen = pick(run_ids, mine, others) if run_ids else mine[-5:]
    spec = project.rel(project.spec_path)
    if not chosen:
        out.print(f"no runs of {spec} yet (`conveyor run{project.spec_option}` makes one)", highlight=False)
        return
    rows = rows_of(chosen)
    title = f"{name} ({spec}): {len(chosen)} run{'s' if len(chosen) != 1 else ''}"
    if as_json or as_csv:
        from conveyor.cli.history import machine_rows

        sys.stdout.write(machine_rows(rows, "json" if as_json else "csv"))
    else:
        _print_whole(compare_table(rows, title, out.width, every))
    if page is not None:
        from conveyor.cli.chart import chart_page
        from conveyor.workspace import replace_atomically

        replace_atomically(page, chart_page(rows, [r.run_id for r in chosen], title))
        (err if as_json or as_csv else out).print(f"wrote {page}", highlight=False, soft_wrap=True)


def _print_whole(table: Table) -> None:
    """Print ``table`` uncut, wider than the terminal if need be (it wraps the lines): run ids
    and values stay whole, to be copied, grepped or paged with ``less -S``."""
    from conveyor.cli.history import natural_width

    width = out.width
    out.width = max(width, natural_width(table))
    try:
        out.print(table)
    finally:
        out.width = width


def _past_runs(config: Path | None) -> tuple[Place, str, list[RunRecord], list[RunRecord]]:
    """Where the spec lives, its pipeline's name, its readable runs (oldest first) and those of
    other specs. The project is located, not loaded: past runs need no stage of it."""
    from conveyor.cli.history import of_spec
    from conveyor.run.record import load_runs

    project, name = place_of(config)
    every, unreadable = load_runs(project.root)
    for path in unreadable:
        err.print(f"skipped {project.rel(path)}: not a readable run record", style="yellow", highlight=False)
    mine = of_spec(every, project.rel(project.spec_path), default=not project.spec_option)
    ids = {r.run_id for r in mine}
    return project, name, mine, [r for r in every if r.run_id not in ids]


def _plot_path(path: Path) -> Path:
    """Where --plot writes, checked before anything is read."""
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory: name a file (e.g. --plot compare.html)")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: the directory {path.parent} does not exist")
    return path
