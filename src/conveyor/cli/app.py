"""The ``conveyor`` command line: parse, call the rooms, map errors to exit codes.

Exit codes (SPEC.md section 4): 0 ok, 1 a stage failed, 2 a bad spec or usage. Errors
print as one clear message, never a traceback. Prefect is imported only by ``run``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from conveyor.cli import run, signals  # noqa: F401 - run: `conveyor run` registers first, at the top of --help
from conveyor.cli.common import SpecOption, app, complete_stages, err, out, place_of, project_of, recover_outs
from conveyor.cli.exits import exit_now, usage_error
from conveyor.errors import UNWRITABLE, ConveyorError, UnwritableError, UsageError
from conveyor.spec.project import Project


@app.command()
def validate(config: SpecOption = None) -> None:
    """Check the spec and its params; exit 2 listing every problem."""
    project = project_of(config)
    n = len(project.pipeline.stages)
    out.print(f"{project.rel(project.spec_path)}: ok ({n} stage{'s' if n != 1 else ''}, "
              f"{len(project.pipeline.profiles)} profiles)")
    _warn_undeclared_code(project)


def _warn_undeclared_code(project: Project) -> None:
    """A cmd stage's script or a local module it imports that its deps miss: a change to it reruns nothing."""
    from conveyor.spec.scripts import undeclared_code

    for problem in undeclared_code(project):
        err.print(f"warning: {problem}", style="yellow", highlight=False, soft_wrap=True)


@app.command()
def status(
    config: SpecOption = None,
    exit_code: Annotated[bool, typer.Option(
        "--exit-code", metavar="", help="Exit 1 when any stage is stale (for CI and scripts).")] = False,
) -> None:
    """Which stages are stale, and why (dep, param, code changed)."""
    from conveyor.cli.checkpoints import status_notes
    from conveyor.cli.view import status_table
    from conveyor.dvc.status import stale

    project = project_of(config)
    _warn_undeclared_code(project)
    recover_outs(project)
    reasons = stale(project, set(project.order))
    out.print(status_table(reasons, status_notes(project, reasons)))  # with the checkpoint a stale stage resumes
    if exit_code and any(reasons.values()):
        raise typer.Exit(1)


@app.command()
def logs(
    stage: Annotated[str, typer.Argument(metavar="STAGE", autocompletion=complete_stages, hidden=True)],
    run_id: Annotated[str | None, typer.Option(
        "--run", metavar="ID", help="A run id (.conveyor/runs/); default: the last run that ran the stage.")] = None,
    config: SpecOption = None,
) -> None:
    """Print a stage's log: its task's logging and prints, its libraries' output, a command's lines."""
    from conveyor.run.logs import find_log

    root = place_of(config)[0].root if config else _root_for_logs()  # a log needs no stage loaded
    path, found_run = find_log(root, stage, run_id)
    err.print(f"log of {stage}, run {found_run}: {path}", style="dim", highlight=False, soft_wrap=True)
    sys.stdout.write(path.read_text(encoding="utf-8", errors="replace"))


def _root_for_logs() -> Path:
    from conveyor.spec.project import find_root

    return find_root(Path.cwd())


from conveyor.cli import graph  # noqa: E402, F401 - `conveyor dag` registers here, in its place in --help


@app.command("compile")
def compile_dvc(
    config: SpecOption = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 with a diff if dvc.yaml drifted.")] = False,
) -> None:
    """Write dvc.yaml from the spec, so `dvc repro` runs the same pipeline (never over a hand-written one)."""
    from conveyor.dvc.compile import drift, dvc_yaml, refuse_hand_written, write_dvc_yaml

    project = project_of(config)
    if project.dvc is not None:
        raise UsageError(f"{project.rel(project.spec_path)} runs {project.rel(project.dvc.file)} as it is: there is "
                         "nothing to compile (compile writes dvc.yaml from a conveyor spec such as "
                         "configs/pipeline.yaml)")
    refuse_hand_written(dvc_yaml(project))  # --check too: a hand-written dvc.yaml is no drift to diff
    if check:
        diff = drift(project)
        if diff is not None:
            print(diff, end="")
            err.print(f"dvc.yaml is out of date with {project.rel(project.spec_path)}: run `conveyor compile`")
            raise typer.Exit(1)
        out.print(f"dvc.yaml matches {project.rel(project.spec_path)}")
        return
    from conveyor.dvc.carry import carry_into_dvc_lock, up_to_date_in_own_record

    fresh = up_to_date_in_own_record(project) if (project.root / ".dvc").is_dir() else []
    path = write_dvc_yaml(project)
    out.print(f"wrote {project.rel(path)} ({len(project.order)} stages) from {project.rel(project.spec_path)}")
    carried = carry_into_dvc_lock(project, fresh)
    if carried:
        out.print(f"recorded {len(carried)} up-to-date stage(s) in dvc.lock and the DVC cache, so they do not "
                  f"rerun: {', '.join(carried)}", highlight=False)


@app.command("exec")
def exec_stage(stage: Annotated[str, typer.Argument(metavar="STAGE", autocompletion=complete_stages, hidden=True)],
               config: SpecOption = None) -> None:
    """Run exactly one stage in this process, with its profile (what dvc.yaml calls)."""
    from conveyor.run.exec_stage import run_one

    project = project_of(config)
    found = project.expand([stage])
    if found != [stage]:
        raise UsageError(f"exec runs exactly one stage: '{stage}' is {len(found)} ({', '.join(found)}); name one")
    from conveyor.run.checkpoints import limit

    limit()  # a bad CONVEYOR_CHECKPOINTS_MAX: exit 2 before the stage starts
    from conveyor.cli.warm_task import hand_tasks_over

    hand_tasks_over()  # deterministic tasks: forked by a warm runner of their pins
    from conveyor.run.leftovers import ended_after

    with ended_after(lambda line: err.print(line, style="yellow", highlight=False, soft_wrap=True)):
        run_one(project, stage)


@app.command()
def init(directory: Annotated[Path, typer.Argument(metavar="DIR", hidden=True)] = Path(".")) -> None:
    """Make a new project that runs at once: a task stage, a cmd stage, tests, Prefect flows, git and DVC.

    DIR: where to make it, new or empty (default: here).
    """
    from conveyor.scaffold import init_project

    made = init_project(directory)
    root = made.root
    cd = "" if root == Path.cwd().resolve() else f"  cd {directory}\n"
    out.print(f"made the conveyor project {root.name} in {root} ({made.git})\nnext:\n{cd}"
              "  conveyor run               # run the pipeline\n"
              "  pip install -e \".[test]\"   # the project's test dependencies (pytest), once\n"
              "  python -m pytest           # the project's tests",
              highlight=False, markup=False, soft_wrap=True)


@app.command()
def schema() -> None:
    """Print the spec's JSON Schema, for editors (`conveyor schema > .conveyor-schema.json`)."""
    from conveyor.spec.schema import schema_text

    sys.stdout.write(schema_text())


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


from conveyor.cli import checkpoints, model, past, search, server  # noqa: E402, F401 - their commands register on app, after these


def main() -> None:
    """Console entry point: one message and an exit code for every conveyor error."""
    signals.install()
    try:
        code = app(standalone_mode=False)  # click returns the code of typer.Exit here
    except ConveyorError as exc:
        print(str(exc), file=sys.stderr)  # one line per problem, never wrapped
        exit_now(exc.exit_code)
    except OSError as exc:  # a write refused where conveyor did not expect one: one line all the same
        if exc.errno not in UNWRITABLE:
            raise
        print(str(UnwritableError.of(exc)), file=sys.stderr)
        exit_now(1)
    except typer.Exit as exc:
        exit_now(exc.exit_code)
    except KeyboardInterrupt:
        signals.stopped(err)
    except typer.TyperException as exc:  # usage errors: since typer 0.29 (it vendors click) all derive from it
        usage_error(exc)
    except Exception as exc:  # Prefect's settings or credentials wrong: one line; anything else is a bug
        from conveyor.prefect.setting_error import explained

        if (said := explained(exc)) is None:
            raise
        print(str(said), file=sys.stderr)
        exit_now(said.exit_code)
    if signals.received() and code == 130:  # typer turns KeyboardInterrupt into exit code 130
        signals.stopped(err)
    exit_now(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
