"""``conveyor run``: decide under the run's locks, then run the due stages as a Prefect flow.

Nothing heavy starts before the decision: when every selected stage is up to date, no Prefect,
server or cluster starts (:func:`conveyor.run.session.nothing_to_do`).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from conveyor.cli import signals
from conveyor.cli.common import (
    AllowMissingOption,
    AllPipelinesOption,
    DownstreamOption,
    DryRunOption,
    ForceDownstreamOption,
    ForceOption,
    GlobOption,
    KeepGoingOption,
    NoCommitOption,
    NoRunCacheOption,
    PipelineOption,
    ProfileOption,
    PullOption,
    RecursiveOption,
    SetParamOption,
    SingleOption,
    SpecOption,
    StagesArg,
    VerboseOption,
    app,
    err,
    out,
    profile_swaps,
    project_of,
    recover_outs,
)
from conveyor.errors import Interrupted, UnwritableError, UsageError
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
    pipeline: PipelineOption = False,
    all_pipelines: AllPipelinesOption = False,
    keep_going: KeepGoingOption = False,
    no_commit: NoCommitOption = False,
    allow_missing: AllowMissingOption = False,
    no_run_cache: NoRunCacheOption = False,
    pull: PullOption = False,
    glob: GlobOption = False,
    recursive: RecursiveOption = False,
    verbose: VerboseOption = False,
) -> None:
    """Run the pipeline as a Prefect flow; unchanged stages are skipped.

    STAGE...: the stages to run, with their upstream (all when omitted).
    """
    # the whole repository's stages where the selection may reach past this dvc.yaml's upstream:
    # every pipeline (-P), a directory's (-R), the stages downstream of a target in other dvc.yaml files
    everything = all_pipelines or recursive or (downstream and bool(stages))
    project = project_of(config, all_pipelines=everything)
    changes = parse_overrides(set_param or [], project.root, project.params_path)
    texts = rendered(changes) if changes else {}
    if project.params_path in texts:  # the project as the run sees it, checked before anything is written
        project = load_project(project.spec_path, params_text=texts[project.params_path],
                               all_pipelines=everything)
    del keep_going  # what conveyor always does: accepted, so a `dvc repro -k` command line works as it is
    if pipeline or all_pipelines:  # as dvc repro: whole pipelines, neither -s nor --downstream
        single_item = downstream = False
    targets = [] if all_pipelines else _in_folders(project, stages or []) if recursive else \
        project.expand(stages or [], glob=glob)
    if single_item and not targets:
        raise UsageError("-s/--single-item runs only the stages you name: name at least one "
                         f"(stages: {', '.join(project.order)})")
    if single_item and downstream:
        raise UsageError("-s/--single-item and --downstream contradict each other: pass one of them")
    swaps = profile_swaps(profile or [])
    from conveyor.run.profiles import Profiles

    Profiles(project.pipeline.profiles, swaps)  # unknown profile names: exit 2 before any work
    from conveyor.run.checkpoints import limit

    limit()  # a bad CONVEYOR_CHECKPOINTS_MAX: exit 2 before any work
    from conveyor.cli.warm_task import hand_tasks_over

    hand_tasks_over()  # deterministic tasks: forked by a warm runner of their pins
    selected = dag.select(project.graph, targets, downstream=downstream, single=single_item, pipeline=pipeline)
    if dry_run:
        recover_outs(project)
        from conveyor.cli.view import status_table
        from conveyor.dvc.status import stale

        for change in changes:
            err.print(f"-S would set {describe(change, project.root)} (not written: --dry-run)", highlight=False)
        out.print(status_table(stale(project, selected, force=force, changes=changes, allow_missing=allow_missing)))
        return

    def write() -> None:  # under the run's locks: a run refused has written nothing
        write_rendered(texts)
        for change in changes:
            err.print(f"-S set {describe(change, project.root)}", highlight=False)

    from conveyor.run.record import new_run_id
    from conveyor.run.session import RunOptions, nothing_to_do, open_session

    options = RunOptions(tuple(targets), downstream, force, swaps, single=single_item,
                         overrides={c.shown: c.new for c in changes}, force_downstream=force_downstream,
                         pipeline=pipeline, all_pipelines=all_pipelines, no_commit=no_commit,
                         allow_missing=allow_missing, no_run_cache=no_run_cache, pull=pull)
    run_id = new_run_id()
    warn = partial(err.print, style="yellow", highlight=False)
    from conveyor.cli.view import resume_command, summary
    from conveyor.run.leftovers import ended_after

    # Decide first, under the run's locks: when nothing is due, no Prefect, server or cluster starts.
    with ended_after(warn) as end_leftovers:  # what tasks started and left running (conveyor.run.leftovers)
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
            end_leftovers()  # before the exit, which skips what follows
            signals.interrupted_run(out, err, project, run_id, exc, options)
    # the summary is the command's output (stdout: `conveyor run > run.txt` keeps it); the live view,
    # warnings and errors are on stderr
    out.print(summary(record, project, resume_command(project, record, options)), crop=False)
    if record.status != "succeeded":
        raise typer.Exit(1)


def _in_folders(project: Project, folders: list[str]) -> list[str]:
    """``-R``: the stages of every dvc.yaml in each of ``folders`` and below (``dvc repro -R``)."""
    if project.dvc is None:
        raise UsageError("-R/--recursive picks the stages of the dvc.yaml files in a directory: this "
                         f"project runs {project.rel(project.spec_path)}; name its stages instead")
    chosen: list[str] = []
    for folder in folders or ["."]:
        path = (Path.cwd() / folder).resolve()
        if not path.is_dir():
            raise UsageError(f"-R/--recursive: {folder} is not a directory (name a directory of dvc.yaml files)")
        chosen += [s for s in project.order if project.dvc.file_of(s).resolve().is_relative_to(path)]
    if not chosen:
        raise UsageError(f"-R/--recursive: no stage in a dvc.yaml under {', '.join(folders)}")
    return list(dict.fromkeys(chosen))


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
    from conveyor.run.leftovers import marked
    from conveyor.run.record import begin, close_before_flow, fail_run

    # "running" from here on, before a temporary server starts (seconds): a run killed even
    # then leaves a record, which the next command settles as interrupted
    begin(project, session.selected, run_id, session.options.overrides).write(project.root)
    try:
        # what its tasks start carries its id (or stays in its session): the next command ends it, were this killed
        with marked(run_id, project.root):
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
        from conveyor.prefect.tls import share

        share()  # the run's four Prefect clients: one TLS context, not four (conveyor.prefect.tls)
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
