"""What the command modules share: the typer app, the consoles, the options, the project loader.

The commands live in :mod:`conveyor.cli.run` (``run``), :mod:`conveyor.cli.app` (the pipeline's
others), :mod:`conveyor.cli.past` (past runs) and :mod:`conveyor.cli.model` (the model's); each
registers on :data:`app`, and none imports another, so the modules form no cycle.
"""

from __future__ import annotations

from functools import partial
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from conveyor.errors import UsageError
from conveyor.spec.project import Place, Project, load_project, locate, resolve_spec

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Declarative ML pipelines: one YAML spec, one DAG, run as a Prefect flow.")
out = Console()
err = Console(stderr=True)


def consoles_here() -> None:
    """Both consoles as created in this process: rich reads the terminal, its colours and
    ``COLUMNS`` as a console is created. For a warm runner's child (:mod:`conveyor.cli.warm_child`),
    which inherits the consoles of a runner whose output was /dev/null."""
    Console.__init__(out)
    Console.__init__(err, stderr=True)


def complete_stages(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of stage names, read from the spec (``-c`` if already typed)."""
    try:
        config = ctx.params.get("config")
        project = project_of(Path(config) if config else None)
    except Exception:  # noqa: BLE001 - completion offers nothing rather than fail the shell
        return []
    return [name for name in project.order if name.startswith(incomplete)]


# A flag's metavar is "" so help does not show a type (typer 0.29 would print <bool>).
SpecOption = Annotated[Path | None, typer.Option(
    "-c", "--config", metavar="FILE",
    help="Spec file (default: configs/pipeline.yaml under the project root, else its dvc.yaml).")]
# Arguments carry no help= (typer would print their Python type): commands describe them.
StagesArg = Annotated[list[str] | None, typer.Argument(metavar="STAGE", autocompletion=complete_stages, hidden=True)]
DownstreamOption = Annotated[bool, typer.Option(
    "--downstream", metavar="", help="Run the given stages and everything after them.")]
SingleOption = Annotated[bool, typer.Option(
    "-s", "--single-item", metavar="", help="Run only the given stages, not their upstream (as dvc repro -s).")]
ForceOption = Annotated[bool, typer.Option(
    "--force", "-f", metavar="", help="Run selected stages even when up to date.")]
ForceDownstreamOption = Annotated[bool, typer.Option(
    "--force-downstream", metavar="", help="Also run every stage after one that runs, changed or not (as dvc repro).")]
DryRunOption = Annotated[bool, typer.Option(
    "--dry-run", "--dry", metavar="", help="Show what would run and why; run nothing.")]
ProfileOption = Annotated[list[str] | None, typer.Option(
    "--profile", metavar="NAME=PROFILE", help="Swap a profile for this run (repeatable).")]
SetParamOption = Annotated[list[str] | None, typer.Option(
    "-S", "--set-param", metavar="KEY=VALUE",
    help="Set a param in the params file, then run, as dvc exp run -S (repeatable; FILE:KEY=VALUE: another file).")]
PipelineOption = Annotated[bool, typer.Option(
    "--pipeline", "-p", metavar="", help="Run the whole pipelines the given stages belong to (as dvc repro -p).")]
AllPipelinesOption = Annotated[bool, typer.Option(
    "--all-pipelines", "-P", metavar="",
    help="Run every pipeline of every dvc.yaml in the repository (as dvc repro -P).")]
KeepGoingOption = Annotated[bool, typer.Option(
    "--keep-going", "-k", metavar="",
    help="Go on with the stages a failure does not block (as dvc repro -k): what conveyor always does.")]
NoCommitOption = Annotated[bool, typer.Option(
    "--no-commit", metavar="", help="Do not put outs into the DVC cache (as dvc repro; `dvc commit` later).")]
AllowMissingOption = Annotated[bool, typer.Option(
    "--allow-missing", metavar="", help="Skip stages whose only change is missing data (as dvc repro).")]
NoRunCacheOption = Annotated[bool, typer.Option(
    "--no-run-cache", metavar="", help="Run stage commands even where DVC's run cache has their outs (as dvc repro).")]
PullOption = Annotated[bool, typer.Option(
    "--pull", metavar="", help="Pull missing data and the run cache from the DVC remote (as dvc repro).")]
GlobOption = Annotated[bool, typer.Option(
    "--glob", metavar="", help="Stage names may hold shell-style wildcards: 'train@*' (as dvc repro).")]
RecursiveOption = Annotated[bool, typer.Option(
    "--recursive", "-R", metavar="",
    help="Each target is a directory: every stage of the dvc.yaml files in it (as dvc repro -R).")]
VerboseOption = Annotated[bool, typer.Option(
    "-v", "--verbose", metavar="", help="Also show what stages and their libraries print (always in the stage logs).")]


def _print_version(value: bool) -> None:
    if value:
        out.print(f"conveyor {installed_version('conveyor')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", metavar="", callback=_print_version, is_eager=True, help="Print the version and exit.")] = False,
             ) -> None:
    """Declarative ML pipelines: one YAML spec, one DAG, run as a Prefect flow."""


def project_of(config: Path | None, *, all_pipelines: bool = False) -> Project:
    """The project of the spec ``-c`` names, or the one found from the working directory
    (``all_pipelines``: with every dvc.yaml of the repository, ``dvc repro -P``)."""
    return load_project(resolve_spec(config), all_pipelines=all_pipelines)


def place_of(config: Path | None) -> tuple[Place, str]:
    """Where the spec ``-c`` names (or the one found from the working directory) lives and its
    pipeline's name, without loading its stages: for commands that read what past runs left."""
    return locate(resolve_spec(config))


def profile_swaps(pairs: list[str]) -> dict[str, str]:
    """``--profile NAME=PROFILE`` values as a mapping."""
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, target = pair.partition("=")
        if not sep or not name or not target:
            raise UsageError(f"--profile {pair!r}: write it as NAME=PROFILE (e.g. --profile gpu=remote)")
        result[name] = target
    return result


def recover_outs(project: Project) -> None:
    """What a killed run left, recovered where it can be, before a question is answered."""
    from conveyor.run.session import recover_for_question

    recover_for_question(project, partial(err.print, style="yellow", highlight=False, soft_wrap=True))
