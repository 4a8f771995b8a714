"""The ``conveyor`` command line: parse, call the rooms, map errors to exit codes.

Exit codes (SPEC.md section 4): 0 ok, 1 a stage failed, 2 a bad spec or usage. Errors
print as one clear message, never a traceback. Prefect is imported only by ``run``.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from conveyor.cli import signals
from conveyor.cli.common import (
    DownstreamOption,
    DryRunOption,
    ForceDownstreamOption,
    ForceOption,
    ProfileOption,
    SetParamOption,
    SingleOption,
    SpecOption,
    StagesArg,
    VerboseOption,
    app,
    complete_stages,
    err,
    out,
    profile_swaps,
    project_of,
)
from conveyor.cli.exits import exit_now, usage_error
from conveyor.errors import UNWRITABLE, ConveyorError, Interrupted, UnwritableError, UsageError
from conveyor.plan import dag
from conveyor.spec.overrides import describe, parse_overrides, rendered, write_rendered
from conveyor.spec.project import Project, load_project

if TYPE_CHECKING:

    from conveyor.run.record import RunRecord
    from conveyor.run.session import RunSession

@app.command()
def run(
    stages: StagesArg = None,
    config: SpecOption = None,
    downstream: DownstreamOption = False,
    single_item: SingleOption = False,
    force: ForceOption = False,
    force_downstream: ForceDownstreamOption = False,
    dry_run: DryRunOption = False,
    profile: ProfileOption = None,
    set_param: SetParamOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run the pipeline as a Prefect flow; unchanged stages are skipped.

    STAGE...: the stages to run, with their upstream (all when omitted).
    """
    project = project_of(config)
    changes = parse_overrides(set_param or [], project.root, project.params_path)
    texts = rendered(changes) if changes else {}
    if project.params_path in texts:  # the project as the run sees it, checked before anything is written
        project = load_project(project.spec_path, params_text=texts[project.params_path])
    targets = project.expand(stages or [])
    if single_item and not targets:
        raise UsageError("-s/--single-item runs only the stages you name: name at least one "
                         f"(stages: {', '.join(project.order)})")
    if single_item and downstream:
        raise UsageError("-s/--single-item and --downstream contradict each other: pass one of them")
    swaps = profile_swaps(profile or [])
    from conveyor.run.profiles import Profiles

    Profiles(project.pipeline.profiles, swaps)  # unknown profile names: exit 2 before any work
    selected = dag.select(project.graph, targets, downstream=downstream, single=single_item)
    if dry_run:
        _recover_outs(project)
        from conveyor.cli.view import status_table
        from conveyor.dvc.status import stale

        for change in changes:
            err.print(f"-S would set {describe(change, project.root)} (not written: --dry-run)", highlight=False)
        out.print(status_table(stale(project, selected, force=force, changes=changes)))
        return

    def write() -> None:  # under the run's locks: a run refused has written nothing
        write_rendered(texts)
        for change in changes:
            err.print(f"-S set {describe(change, project.root)}", highlight=False)

    from conveyor.run.record import new_run_id
    from conveyor.run.session import RunOptions, nothing_to_do, open_session

    options = RunOptions(tuple(targets), downstream, force, swaps, single=single_item,
                         overrides={c.shown: c.new for c in changes}, force_downstream=force_downstream)
    run_id = new_run_id()
    warn = partial(err.print, style="yellow", highlight=False)
    from conveyor.cli.view import resume_command, summary

    # Decide first, under the run's locks: when nothing is due, no Prefect, server or cluster starts.
    try:
        recompiled = _recompiled_note(project)
        with open_session(project, options, warn=warn, write=write if texts else None) as session:
            if recompiled:
                err.print(recompiled, highlight=False, soft_wrap=True)
            if session.nothing_to_do:
                record = nothing_to_do(session, run_id)
            else:
                record = _run_flow(project, session, run_id, verbose)
    except KeyboardInterrupt as exc:
        signals.interrupted_run(out, err, project, run_id, exc, options)
    # the summary is the command's output (stdout: `conveyor run > run.txt` keeps it); the live view,
    # warnings and errors are on stderr
    out.print(summary(record, project, resume_command(project, record, options)), crop=False)
    if record.status != "succeeded":
        raise typer.Exit(1)


def _recompiled_note(project: Project) -> str | None:
    """What the run says when it compiles dvc.yaml again (it is conveyor's, and the spec or
    the params it expands, such as a sweep's list, changed); None when it matches."""
    from conveyor.dvc.compile import compiled_from, drift

    if project.dvc is not None or not compiled_from(project) or drift(project) is None:
        return None
    return (f"dvc.yaml compiled again from {project.rel(project.spec_path)} and its params "
            "(commit it with dvc.lock)")


def _run_flow(project: Project, session: RunSession, run_id: str, verbose: bool) -> RunRecord:
    """Run the session's due stages as a Prefect flow: on the configured server, else a temporary one."""
    from conveyor.errors import PrefectServerGone
    from conveyor.run.record import begin, close_before_flow, fail_run

    # "running" from here on, before a temporary server starts (seconds): a run killed even
    # then leaves a record, which the next command settles as interrupted
    begin(project, session.selected, run_id, session.options.overrides).write(project.root)
    try:
        return _flow_on_server(project, session, run_id, verbose)
    except PrefectServerGone as exc:  # the stages keep their outcome; the run failed for the server
        fail_run(project, run_id, str(exc))
        raise
    except UnwritableError:  # not "failed before it started": the next command settles it from its events
        raise
    except Exception as exc:  # e.g. the server did not start: the record must not stay "running"
        from conveyor.run.failures import short_error

        why = f"the run failed before it started: {short_error(exc)}"
        close_before_flow(project, run_id, interrupted=False, why=why)
        raise


def _flow_on_server(project: Project, session: RunSession, run_id: str, verbose: bool) -> RunRecord:
    from conveyor.prefect.server import lost_while_running, prefect_api
    from conveyor.run.capture import capture_output
    from conveyor.run.logs import log_path

    # Prefect is imported (by prefect_api, while a temporary server starts) before the capture:
    # its console handler keeps the real stderr, which the capture then sends to run.log.
    with prefect_api(log_path(project.root, run_id, "prefect-server")) as url:
        from prefect.exceptions import TerminationSignal

        from conveyor.prefect.flow import run_pipeline

        # The terminal shows the live view; everything else is in the logs (run.log: Prefect, Dask workers, ...).
        with capture_output(log_path(project.root, run_id, "run"), verbose=verbose), \
                lost_while_running(url, _recorded_in(session)):
            try:
                record = run_pipeline(session, run_id)
            except TerminationSignal as exc:  # Prefect's flow turns SIGTERM into this
                raise Interrupted("SIGTERM") from exc
        # Prefect's workers drain at exit and log that at INFO on the terminal, below the summary
        logging.getLogger("prefect").setLevel(logging.WARNING)
    return record


def _recorded_in(session: RunSession) -> str:
    """Where a run's stages are recorded: dvc.lock (DVC's record), else conveyor's own, and the run record."""
    from conveyor.dvc.record import DvcRecord

    record = getattr(session.record, "inner", session.record)  # a ForcedRecord wraps the project's record
    return "dvc.lock and .conveyor/runs" if isinstance(record, DvcRecord) else ".conveyor/locks and .conveyor/runs"


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
    _recover_outs(project)
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

    root = project_of(config).root if config else _root_for_logs()
    path, found_run = find_log(root, stage, run_id)
    err.print(f"log of {stage}, run {found_run}: {path}", style="dim", highlight=False, soft_wrap=True)
    sys.stdout.write(path.read_text(encoding="utf-8", errors="replace"))


def _root_for_logs() -> Path:
    from conveyor.spec.project import find_root

    return find_root(Path.cwd())


def _recover_outs(project: Project) -> None:
    """What a killed run left, recovered where it can be, before a question is answered."""
    from conveyor.run.session import recover_for_question

    recover_for_question(project, partial(err.print, style="yellow", highlight=False, soft_wrap=True))


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
    from conveyor.dvc.record import carry_into_dvc_lock, up_to_date_in_own_record

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
    if signals.received() and code == 130:  # typer turns KeyboardInterrupt into exit code 130
        signals.stopped(err)
    exit_now(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
