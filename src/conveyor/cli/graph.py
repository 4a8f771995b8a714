"""``conveyor dag``: the pipeline's graph as text, Mermaid, Graphviz dot, or a page to open in a browser."""

from __future__ import annotations

from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from conveyor.cli.common import SpecOption, app, err, out, project_of
from conveyor.errors import UsageError
from conveyor.spec.project import Project

PAGE = "dag.html"  # where the page goes by default, in .conveyor/ (git ignores it)


class DagFormat(StrEnum):
    text = "text"
    mermaid = "mermaid"
    dot = "dot"
    html = "html"


@app.command("dag")
def show_dag(
    config: SpecOption = None,
    fmt: Annotated[DagFormat, typer.Option("--format", help="text, mermaid, dot or html.")] = DagFormat.text,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE",
        help="Write here (- for stdout); html's default: .conveyor/dag.html, the others print.")] = None,
) -> None:
    """Print the DAG; --format html writes a page with each stage's state and why (no network needed)."""
    project = project_of(config)
    target = _output_path(output) if output is not None and str(output) != "-" else None
    if fmt is not DagFormat.html:
        from conveyor.cli.render import render_dag

        text = render_dag(project, fmt.value)
        if target is None:
            out.print(text, highlight=False, markup=False)
        else:
            _write(project, target, text + "\n")
        return
    page = _page(project)
    if output is not None and str(output) == "-":
        typer.echo(page, nl=False)
        return
    _write(project, target or _default_page(project), page)


def _page(project: Project) -> str:
    """The page: the status question asked as ``conveyor status`` asks it, then drawn."""
    from conveyor.cli.dag_page import dag_page
    from conveyor.dvc.status import stale
    from conveyor.run.session import recover_for_question

    recover_for_question(project, partial(err.print, style="yellow", highlight=False, soft_wrap=True))
    return dag_page(project, stale(project, set(project.order)))


def _default_page(project: Project) -> Path:
    from conveyor.workspace import state_dir

    return state_dir(project.root) / PAGE


def _write(project: Project, path: Path, text: str) -> None:
    from conveyor.workspace import replace_atomically

    replace_atomically(path, text)
    out.print(f"wrote {project.rel(path)}: open {path.resolve().as_uri()}", highlight=False, soft_wrap=True)


def _output_path(path: Path) -> Path:
    """Where --output writes, checked before anything is read."""
    if path.is_dir():
        raise UsageError(f"--output {path} is a directory: name a file (e.g. -o dag.html)")
    if not path.parent.is_dir():
        raise UsageError(f"--output {path}: the directory {path.parent} does not exist")
    return path
