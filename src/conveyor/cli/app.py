"""The ``conveyor`` command line: parse, call the rooms, map errors to exit codes.

Exit codes (SPEC.md section 4): 0 ok, 1 a stage failed, 2 a bad spec or usage. Errors
print as one clear message, never a traceback. Prefect is imported only by ``run``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from enum import StrEnum
from functools import partial
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from conveyor.cli import signals
from conveyor.errors import UNWRITABLE, ConveyorError, Interrupted, UnwritableError, UsageError
from conveyor.plan import dag
from conveyor.spec.overrides import describe, parse_overrides, reads, write_overrides
from conveyor.spec.project import Project, load_project, resolve_spec

if TYPE_CHECKING:
    from rich.table import Table

    from conveyor.run.record import RunRecord
    from conveyor.run.session import RunSession

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Declarative ML pipelines: one YAML spec, one DAG, run as a Prefect flow.")
out = Console()
err = Console(stderr=True)


def _complete_stages(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of stage names, read from the spec (``-c`` if already typed)."""
    try:
        config = ctx.params.get("config")
        project = _project(Path(config) if config else None)
    except Exception:  # noqa: BLE001 - completion offers nothing rather than fail the shell
        return []
    return [name for name in project.order if name.startswith(incomplete)]


# A flag's metavar is "" so help does not show a type (typer 0.29 would print <bool>).
SpecOption = Annotated[Path | None, typer.Option(
    "-c", "--config", metavar="FILE",
    help="Spec file (default: configs/pipeline.yaml under the project root, else its dvc.yaml).")]
# Arguments carry no help= (typer would print their Python type): commands describe them.
StagesArg = Annotated[list[str] | None, typer.Argument(metavar="STAGE", autocompletion=_complete_stages, hidden=True)]
DownstreamOption = Annotated[bool, typer.Option(
    "--downstream", metavar="", help="Run the given stages and everything after them.")]
SingleOption = Annotated[bool, typer.Option(
    "-s", "--single-item", metavar="", help="Run only the given stages, not their upstream (as dvc repro -s).")]
ForceOption = Annotated[bool, typer.Option(
    "--force", "-f", metavar="", help="Run selected stages even when up to date.")]
ForceDownstreamOption = Annotated[bool, typer.Option(
    "--force-downstream", metavar="", help="Also run every stage after one that runs, changed or not (as dvc repro).")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", metavar="", help="Show what would run and why; run nothing.")]
ProfileOption = Annotated[list[str] | None, typer.Option(
    "--profile", metavar="NAME=PROFILE", help="Swap a profile for this run (repeatable).")]
SetParamOption = Annotated[list[str] | None, typer.Option(
    "-S", "--set-param", metavar="KEY=VALUE",
    help="Set a param in the params file, then run, as dvc exp run -S (repeatable; FILE:KEY=VALUE: another file).")]
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


def _project(config: Path | None) -> Project:
    return load_project(resolve_spec(config))


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
    project = _project(config)
    changes = parse_overrides(set_param or [], project.root, project.params_path)
    targets = project.expand(stages or [])
    if single_item and not targets:
        raise UsageError("-s/--single-item runs only the stages you name: name at least one "
                         f"(stages: {', '.join(project.order)})")
    if single_item and downstream:
        raise UsageError("-s/--single-item and --downstream contradict each other: pass one of them")
    swaps = _overrides(profile or [])
    from conveyor.run.profiles import Profiles

    Profiles(project.pipeline.profiles, swaps)  # unknown profile names: exit 2 before any work
    selected = dag.select(project.graph, targets, downstream=downstream, single=single_item)
    if dry_run:
        _recover_outs(project)
        from conveyor.cli.view import status_table
        from conveyor.dvc.status import stale

        for change in changes:
            readers = [s for s in project.order if s in selected and reads(project, s, change)]
            also = f"; the stages that read it would run too: {', '.join(readers) or 'none'}" \
                if project.dvc is None else ""  # a dvc.yaml's stages name their params for DVC only
            err.print(f"-S would set {describe(change, project.root)} (not written: --dry-run){also}",
                      highlight=False)
        out.print(status_table(stale(project, selected, force=force)))
        return
    if changes:  # written as `dvc exp run -S` writes them, then the project is read again
        from conveyor.workspace import run_lock

        with run_lock(project.root):  # not while another run reads the file
            write_overrides(changes)
        for change in changes:
            err.print(f"-S set {describe(change, project.root)}", highlight=False)
        project = _project(config)
    from conveyor.run.record import new_run_id
    from conveyor.run.session import RunOptions, nothing_to_do, open_session

    options = RunOptions(tuple(targets), downstream, force, swaps, single=single_item,
                         overrides={c.shown: c.new for c in changes}, force_downstream=force_downstream)
    run_id = new_run_id()
    warn = partial(err.print, style="yellow", highlight=False)
    from conveyor.cli.view import resume_command, summary

    # Decide first, under the run's locks: when nothing is due, no Prefect, server or cluster starts.
    try:
        with open_session(project, options, warn=warn) as session:
            if session.nothing_to_do:
                record = nothing_to_do(session, run_id)
            else:
                record = _run_flow(project, session, run_id, verbose)
    except KeyboardInterrupt as exc:
        signals.interrupted_run(err, project, run_id, exc)
    err.print(summary(record, project, resume_command(project, record)))
    if record.status != "succeeded":
        raise typer.Exit(1)


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
        from conveyor.run.stage import short_error

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
    project = _project(config)
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
    from conveyor.cli.view import status_table
    from conveyor.dvc.status import stale
    from conveyor.run.environment import History

    project = _project(config)
    _warn_undeclared_code(project)
    _recover_outs(project)
    reasons = stale(project, set(project.order))
    history = History(project)
    out.print(status_table(reasons, {stage: history.notes(stage) for stage in reasons}))
    if exit_code and any(reasons.values()):
        raise typer.Exit(1)


@app.command()
def logs(
    stage: Annotated[str, typer.Argument(metavar="STAGE", autocompletion=_complete_stages, hidden=True)],
    run_id: Annotated[str | None, typer.Option(
        "--run", metavar="ID", help="A run id (.conveyor/runs/); default: the last run that ran the stage.")] = None,
    config: SpecOption = None,
) -> None:
    """Print a stage's log: its task's logging and prints, its libraries' output, a command's lines."""
    from conveyor.run.logs import find_log

    root = _project(config).root if config else _root_for_logs()
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


@app.command()
def runs(
    config: SpecOption = None,
    last: Annotated[int, typer.Option("--last", "-n", metavar="N", min=1, help="How many runs to list.")] = 10,
) -> None:
    """List the past runs of the spec, newest first: status, wall time, stages ran/skipped/failed, -S."""
    from conveyor.cli.history import runs_table

    project, found, _ = _past_runs(config)
    if not found:
        out.print(f"no runs of {project.rel(project.spec_path)} yet (`conveyor run{project.spec_option}` makes one)",
                  highlight=False)
        return
    _print_whole(runs_table(found[::-1][:last]))


@app.command()
def compare(
    run_ids: Annotated[list[str] | None, typer.Argument(metavar="RUN", hidden=True)] = None,
    config: SpecOption = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.html", help="Also write an HTML page with a chart per metric (no network needed).")
    ] = None,
) -> None:
    """Params and metrics of runs side by side, matrix items on rows of their own (as dvc exp show).

    RUN...: run ids or unique prefixes of them, shown in that order (default: the last 5 runs, oldest first).
    """
    from conveyor.cli.history import compare_table, pick, rows_of

    page = _plot_path(plot) if plot is not None else None
    project, mine, others = _past_runs(config)
    chosen = pick(run_ids, mine, others) if run_ids else mine[-5:]
    spec = project.rel(project.spec_path)
    if not chosen:
        out.print(f"no runs of {spec} yet (`conveyor run{project.spec_option}` makes one)", highlight=False)
        return
    rows = rows_of(chosen)
    title = f"{project.pipeline.pipeline} ({spec}): {len(chosen)} run{'s' if len(chosen) != 1 else ''}"
    _print_whole(compare_table(rows, title, out.width))
    if page is not None:
        from conveyor.cli.chart import chart_page
        from conveyor.workspace import replace_atomically

        replace_atomically(page, chart_page(rows, [r.run_id for r in chosen], title))
        out.print(f"wrote {page}", highlight=False, soft_wrap=True)


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


def _past_runs(config: Path | None) -> tuple[Project, list[RunRecord], list[RunRecord]]:
    """The project, its readable runs of this spec (oldest first) and those of other specs."""
    from conveyor.cli.history import of_spec
    from conveyor.run.record import load_runs

    project = _project(config)
    every, unreadable = load_runs(project.root)
    for path in unreadable:
        err.print(f"skipped {project.rel(path)}: not a readable run record", style="yellow", highlight=False)
    mine = of_spec(every, project.rel(project.spec_path), default=not project.spec_option)
    ids = {r.run_id for r in mine}
    return project, mine, [r for r in every if r.run_id not in ids]


def _plot_path(path: Path) -> Path:
    """Where --plot writes, checked before anything is read."""
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory: name a file (e.g. --plot compare.html)")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: the directory {path.parent} does not exist")
    return path


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
    """Write dvc.yaml from the spec, so `dvc repro` runs the same pipeline (never over a hand-written one)."""
    from conveyor.dvc.compile import drift, dvc_yaml, refuse_hand_written, write_dvc_yaml

    project = _project(config)
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
def exec_stage(stage: Annotated[str, typer.Argument(metavar="STAGE", autocompletion=_complete_stages, hidden=True)],
               config: SpecOption = None) -> None:
    """Run exactly one stage in this process, with its profile (what dvc.yaml calls)."""
    from conveyor.run.exec_stage import run_one

    project = _project(config)
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


from conveyor.cli import model  # noqa: E402, F401 - registers predict and serve-model on app


def main() -> None:
    """Console entry point: one message and an exit code for every conveyor error."""
    signals.install()
    try:
        code = app(standalone_mode=False)  # click returns the code of typer.Exit here
    except ConveyorError as exc:
        print(str(exc), file=sys.stderr)  # one line per problem, never wrapped
        _exit(exc.exit_code)
    except OSError as exc:  # a write refused where conveyor did not expect one: one line all the same
        if exc.errno not in UNWRITABLE:
            raise
        print(str(UnwritableError.of(exc)), file=sys.stderr)
        _exit(1)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except KeyboardInterrupt:
        signals.stopped(err)
    except typer.TyperException as exc:  # usage errors: since typer 0.29 (it vendors click) all derive from it
        _usage_error(exc)
    if signals.received() and code == 130:  # typer turns KeyboardInterrupt into exit code 130
        signals.stopped(err)
    _exit(code if isinstance(code, int) else 0)


# imported: tearing the modules down takes seconds (DVC's: 0.3 s of a 1.4 s no-op run of 51 stages)
_SLOW_TEARDOWN = ("torch", "prefect", "distributed", "xgboost", "dvc")


def _exit(code: int) -> NoReturn:
    """Exit with ``code``; without waiting for the thread of a stage abandoned at its timeout
    (blocked in a C call: its outs were put back and its record written), nor for Prefect's
    workers to send what they hold to a server that stopped answering (they would for minutes).

    Once torch, Prefect, Dask, XGBoost or DVC are imported, the exit is the interpreter's own
    minus its last step: threads are joined and every exit handler runs (Prefect's,
    logging's, multiprocessing's, thread pools'), then the process ends without tearing its
    modules down, which after a run takes 0.3-2 s and keeps nothing.
    """
    from conveyor.prefect.server import lost
    from conveyor.run.watchdog import stuck

    if stuck() or lost():  # a blocked stage's thread; Prefect's workers waiting on a server that is gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if not any(name in sys.modules for name in _SLOW_TEARDOWN):
        sys.exit(code)
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _usage_error(exc: typer.TyperException) -> NoReturn:
    """One line (did-you-mean included where click has one) and exit 2; no arguments at all shows the help."""
    message = exc.format_message().strip()
    if message.startswith("Usage:"):  # a command given without arguments: its help
        print(message, file=sys.stderr)
        sys.exit(2)
    command = str(getattr(getattr(exc, "ctx", None), "command_path", None) or "conveyor")
    option, possible = getattr(exc, "option_name", None), getattr(exc, "possibilities", None)
    if option and possible:  # click lists every close option; name the closest, as the spec errors do
        from conveyor.spec.models import did_you_mean

        message = f"No such option: {option}{did_you_mean(option, possible)}"
    line = " ".join(message.split())
    print(f"{command}: {line} (see '{command} --help')", file=sys.stderr)
    sys.exit(getattr(exc, "exit_code", 2) or 2)


if __name__ == "__main__":
    main()
