"""The ``conveyor`` command line: parse, call the rooms, map errors to exit codes.

Exit codes (SPEC.md section 4): 0 ok, 1 a stage failed, 2 a bad spec or usage. Errors
print as one clear message, never a traceback. Prefect is imported only by ``run``.
"""

from __future__ import annotations

import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console

from conveyor.errors import ConveyorError, UsageError
from conveyor.plan import dag
from conveyor.spec.project import Project, load_project, resolve_spec

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Declarative ML pipelines: one YAML spec, one DAG, run as a Prefect flow.")
out = Console()
err = Console(stderr=True)

SpecOption = Annotated[Path | None, typer.Option(
    "-c", "--config", help="Spec file (default: configs/pipeline.yaml under the project root).")]
StagesArg = Annotated[list[str] | None, typer.Argument(
    help="Stages to run (with their upstream); all when omitted.")]
DownstreamOption = Annotated[bool, typer.Option("--downstream", help="Run the given stages and everything after them.")]
ForceOption = Annotated[bool, typer.Option("--force", "-f", help="Run selected stages even when up to date.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show what would run and why; run nothing.")]
ProfileOption = Annotated[list[str] | None, typer.Option(
    "--profile", help="Swap a profile for this run: NAME=PROFILE.")]


def _project(config: Path | None) -> Project:
    return load_project(resolve_spec(config))


def _check_stages(project: Project, stages: list[str]) -> None:
    unknown = [s for s in stages if s not in project.pipeline.stages]
    if unknown:
        from conveyor.spec.models import did_you_mean

        hints = "".join(did_you_mean(s, project.pipeline.stages) for s in unknown)
        raise UsageError(f"unknown stage(s): {', '.join(unknown)}{hints}; stages: {', '.join(project.order)}")


def _overrides(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, target = pair.partition("=")
        if not sep or not name or not target:
            raise UsageError(f"--profile {pair!r}: write it as NAME=PROFILE (e.g. --profile gpu=remote)")
        result[name] = target
    return result


@app.command()
def run(
    stages: StagesArg = None,
    config: SpecOption = None,
    downstream: DownstreamOption = False,
    force: ForceOption = False,
    dry_run: DryRunOption = False,
    profile: ProfileOption = None,
) -> None:
    """Run the pipeline as a Prefect flow; unchanged stages are skipped."""
    project = _project(config)
    targets = stages or []
    _check_stages(project, targets)
    overrides = _overrides(profile or [])
    from conveyor.run.profiles import Profiles

    Profiles(project.pipeline.profiles, overrides)  # unknown profile names: exit 2 before any work
    selected = dag.select(project.graph, targets, downstream=downstream)
    if dry_run:
        _recover_outs(project)
        from conveyor.cli.view import status_table
        from conveyor.dvc.record import open_record
        from conveyor.plan.fingerprint import plan

        out.print(status_table(plan(project, selected, open_record(project), force=force)))
        return
    # The live view shows progress; Prefect's INFO lines still reach its API and UI.
    # A failed stage's traceback stays in Prefect's logs; the summary shows the task's own frames.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from conveyor.cli.view import summary
    from conveyor.prefect.flow import RunOptions, resume_command, run_pipeline

    record = run_pipeline(project.spec_path, RunOptions(tuple(targets), downstream, force, overrides))
    err.print(summary(record, resume_command(project, record)))
    if record.status != "succeeded":
        raise typer.Exit(1)


@app.command()
def validate(config: SpecOption = None) -> None:
    """Check the spec and its params; exit 2 listing every problem."""
    project = _project(config)
    n = len(project.pipeline.stages)
    out.print(f"{project.rel(project.spec_path)}: ok ({n} stage{'s' if n != 1 else ''}, "
              f"{len(project.pipeline.profiles)} profiles)")


@app.command()
def status(config: SpecOption = None) -> None:
    """Which stages are stale, and why (dep, param, code changed)."""
    from conveyor.cli.view import status_table
    from conveyor.dvc.record import open_record
    from conveyor.plan.fingerprint import plan

    project = _project(config)
    _recover_outs(project)
    out.print(status_table(plan(project, set(project.order), open_record(project))))


def _recover_outs(project: Project) -> None:
    """Put back the previous outs of stages whose run was killed (kill -9 leaves them to us)."""
    from conveyor.run.journal import RECOVERED, Journal

    for stage in Journal(project.root).recover():
        err.print(RECOVERED.format(stage=stage), style="yellow", highlight=False)


class DagFormat(StrEnum):
    text = "text"
    mermaid = "mermaid"
    dot = "dot"


@app.command("dag")
def show_dag(
    config: SpecOption = None,
    fmt: Annotated[DagFormat, typer.Option("--format", help="text, mermaid or dot.")] = DagFormat.text,
) -> None:
    """Print the DAG."""
    from conveyor.cli.render import render_dag

    project = _project(config)
    out.print(render_dag(project, fmt.value), highlight=False, markup=False)


@app.command("compile")
def compile_dvc(
    config: SpecOption = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 with a diff if dvc.yaml drifted.")] = False,
) -> None:
    """Write dvc.yaml from the spec, so `dvc repro` runs the same pipeline."""
    from conveyor.dvc.compile import drift, dvc_yaml, render

    project = _project(config)
    if check:
        diff = drift(project)
        if diff is not None:
            print(diff, end="")
            err.print(f"dvc.yaml is out of date with {project.rel(project.spec_path)}: run `conveyor compile`")
            raise typer.Exit(1)
        out.print(f"dvc.yaml matches {project.rel(project.spec_path)}")
        return
    path = dvc_yaml(project)
    tmp = path.with_name(".dvc.yaml.tmp")
    tmp.write_text(render(project), encoding="utf-8")
    os.replace(tmp, path)
    out.print(f"wrote {project.rel(path)} ({len(project.order)} stages) from {project.rel(project.spec_path)}")


@app.command("exec")
def exec_stage(stage: Annotated[str, typer.Argument(help="The stage to run.")], config: SpecOption = None) -> None:
    """Run exactly one stage in this process, with its profile (what dvc.yaml calls)."""
    from conveyor.run.stage import run_one

    project = _project(config)
    _check_stages(project, [stage])
    run_one(project, stage)


@app.command()
def init(directory: Annotated[Path, typer.Argument(help="Where to make the project (new or empty).")] = Path(".")
         ) -> None:
    """Make a new project that runs at once: a task stage, a cmd stage, tests, Prefect flows, git and DVC."""
    from conveyor.scaffold import init_project

    root = init_project(directory)
    cd = "" if root == Path.cwd().resolve() else f"  cd {directory}\n"
    out.print(f"made the conveyor project {root.name} in {root} (git and DVC initialised)\nnext:\n{cd}"
              "  conveyor run          # run the pipeline\n  python -m pytest      # the project's tests",
              highlight=False)


@app.command()
def deploy() -> None:
    """Register the prefect.yaml deployments (pipeline, retrain); create their process work pool if missing."""
    from conveyor.prefect.deploy import deploy_all
    from conveyor.spec.project import find_root

    deploy_all(find_root(Path.cwd()))


@app.command()
def serve(
    limit: Annotated[int, typer.Option("--limit", min=1, help="Flow runs at once (they share the workspace).")] = 1,
) -> None:
    """Serve the prefect.yaml deployments from this process (Prefect serve) until Ctrl-C; no work pool needed."""
    from conveyor.prefect.deploy import serve_all
    from conveyor.spec.project import find_root

    serve_all(find_root(Path.cwd()), limit=limit)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    """Console entry point: one message and an exit code for every conveyor error."""
    signal.signal(signal.SIGTERM, _interrupt)  # clean up clusters on `kill` as on Ctrl-C
    try:
        code = app(standalone_mode=False)  # click returns the code of typer.Exit here
    except ConveyorError as exc:
        print(str(exc), file=sys.stderr)  # one line per problem, never wrapped
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted: clusters and workers were stopped; outs of unfinished stages are unchanged")
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
