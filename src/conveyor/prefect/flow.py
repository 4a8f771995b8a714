"""The pipeline as a Prefect flow: one Prefect task per stage that runs, submitted when its upstream succeeded.

The scheduling loop lives here once: :class:`conveyor.run.schedule.Schedule` says which stages
may start; each that is due (:class:`conveyor.run.session.RunSession`) becomes a Prefect task
on the flow's thread-pool task runner, each that is up to date is recorded skipped on the
spot, and a finished future is an event that may release its dependents. Independent
branches therefore run at the same time; a failure stops only what depends on it.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import State, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from conveyor.errors import Interrupted, UsageError
from conveyor.prefect import heartbeats
from conveyor.prefect.edges import submit_connected, upstream_runs
from conveyor.prefect.parameters import json_flow
from conveyor.prefect.server import raise_if_gone
from conveyor.run import capture
from conveyor.run.compare import artifact_rows
from conveyor.run.environment import History
from conveyor.run.failures import redacted, short_error
from conveyor.run.leftovers import ended_after, marked
from conveyor.run.live import RunView
from conveyor.run.metrics import stage_metrics
from conveyor.run.profiles import Profiles
from conveyor.run.record import INTERRUPTED, RUNNING, RunEvents, RunRecord, begin, new_run_id, now
from conveyor.run.schedule import Outcome, Schedule
from conveyor.run.session import UP_TO_DATE, RunOptions, RunSession, check_options, open_session
from conveyor.run.stage import StageRunner
from conveyor.run.watchdog import stuck
from conveyor.spec.overrides import describe, parse_overrides, write_overrides
from conveyor.spec.project import Project, load_project, resolve_spec
from conveyor.workspace import run_lock

log = logging.getLogger("conveyor")
# stages with no profile run in the runner's own process tree: as many at once as there are cores
LOCAL_STAGES = os.cpu_count() or 1


class StageTaskRunner(ThreadPoolTaskRunner[Any]):
    """Prefect's thread-pool task runner, except that a flow ending on an exception (Ctrl-C),
    or with a stage abandoned at its timeout, does not wait for its threads: a stage blocked in
    a C call would hold the run for as long as the call lasts. conveyor has put back that
    stage's outs; the thread ends with the process."""

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        let_go(self, only_if_stuck=exc_type is None)
        super().__exit__(exc_type, exc_value, traceback)


def let_go(runner: TaskRunner[Any] | None, *, only_if_stuck: bool = False) -> None:
    """Tell a thread-pool task runner not to wait for its threads when it exits (only if a stage's
    thread is stuck, with ``only_if_stuck``): its pool shuts down without joining, and its exit,
    which joins whatever pool it still has, finds none. A stage blocked in a C call would
    otherwise hold the flow run, and its process, for as long as the call lasts."""
    if only_if_stuck and not stuck():
        return
    if isinstance(runner, ThreadPoolTaskRunner) and runner._executor is not None:
        for event in runner._cancel_events.values():
            event.set()
        runner._executor.shutdown(wait=False, cancel_futures=True)
        runner._executor = None


def _stage_task(stage: str, runner: StageRunner, upstream: Sequence[str] = ()) -> str:
    """Run ``stage``; ``upstream`` names its upstream stages' task runs, for Prefect's graph (see edges)."""
    try:
        return runner(stage).value
    except Exception as exc:  # Prefect stores the message and logs the traceback: never with a credential
        safe = redacted(exc)
        if safe is exc:
            raise
        raise safe from None


def execute(session: RunSession, view: RunView, run: RunRecord, events: RunEvents | None = None) -> RunRecord:
    """Run the due stages of ``session``, each as soon as its upstream succeeded; fills ``run``.

    A stage that is up to date is recorded skipped where the loop reaches it: only stages
    that run become Prefect task runs (the summary artifact lists the others). ``events``
    hears each stage start and end (a killed run's record is settled from them).

    Ctrl-C or SIGTERM (KeyboardInterrupt here) stops every running stage; one blocked in a
    call Python cannot interrupt (a C call) is given :data:`INTERRUPT_GRACE_S`, then
    abandoned: its previous outs are put back at once and its thread ends with the process.
    """
    note = events.stage if events is not None else (lambda _stage, _record: None)
    project, options = session.project, session.options
    local = {stage: "local" for stage, spec in project.pipeline.stages.items() if spec.on is None}
    schedule = Schedule(project.graph, session.selected, order=project.order,
                        pool_of=local, limits={"local": LOCAL_STAGES})
    finished: queue.Queue[str] = queue.Queue()  # stages whose task run ended
    futures: dict[str, Any] = {}
    began: dict[str, float] = {}
    t0 = time.monotonic()
    with Profiles(project.pipeline.profiles, options.profiles) as profiles:
        for warning in profiles.check({project.pipeline.stages[s].on for s in schedule.order}):
            view.console.print(f"[bold yellow]WARNING[/] {warning}")
        runner = StageRunner(project, profiles, options.force, run, view, session.record,
                             echo=capture.verbose_echo())  # -v: a command's own lines too
        history = History(project)  # what changed in a stage's environment since its last run: said in its reason
        runner.on_abandon = finished.put  # abandoned at its timeout: its task run has not ended

        def start(stage: str) -> bool:
            """Submit ``stage`` as a task run if it is due; False when it is skipped (no task run)."""
            reasons = session.due(stage)
            record = run.stages[stage]
            record.profile = profiles.resolve(project.pipeline.stages[stage].on) or "local"
            record.started = now().isoformat()
            if not reasons:
                record.status, record.reason, record.finished = Outcome.SKIPPED.value, UP_TO_DATE, record.started
                view.finished(stage, Outcome.SKIPPED, 0.0, UP_TO_DATE)
                schedule.finish(stage, Outcome.SKIPPED)
                note(stage, record)
                return False
            record.status, record.reason = RUNNING, "; ".join([*reasons, *history.notes(stage)])
            note(stage, record)
            spec = project.pipeline.stages[stage]
            # timeout_s: the runner enforces it (a command's process group is killed; a task
            # blocked in a C call is abandoned, which Prefect's own task timeout cannot do)
            prefect_task = task(name=stage, task_run_name=stage, retries=spec.retries,
                                retry_delay_seconds=spec.retry_delay_s,
                                cache_policy=NO_CACHE, persist_result=False)(_stage_task)
            began[stage] = time.monotonic()
            futures[stage] = submit_connected(prefect_task, {"stage": stage, "runner": runner},
                                              upstream_runs(project.graph, stage, futures))
            futures[stage].add_done_callback(lambda _f: finished.put(stage))
            return True

        def start_ready() -> None:
            ready = schedule.ready()
            while ready:  # a skipped stage may release its dependents at once
                skipped = [stage for stage in ready if not start(stage)]
                ready = schedule.ready() if skipped else []

        interrupted = False
        try:
            start_ready()
            while not schedule.finished:
                stage = _next_finished(finished)
                if stage not in schedule.running:  # abandoned at its timeout, and now its thread ended
                    continue
                abandoned = runner.abandoned(stage)
                outcome = _finish(stage, futures[stage], time.monotonic() - began[stage], run, view, abandoned)
                if abandoned is not None:
                    _fail_task_run(futures[stage], short_error(abandoned))
                note(stage, run.stages[stage])
                if outcome is Outcome.SUCCEEDED:
                    session.ran.add(stage)
                for lost in schedule.finish(stage, outcome):
                    run.stages[lost].reason = f"upstream '{stage}' failed"
                    view.finished(lost, Outcome.NOT_RUN, 0.0, run.stages[lost].reason)
                start_ready()
        except (KeyboardInterrupt, TerminationSignal) as exc:  # Ctrl-C; SIGTERM, as Prefect's flow raises it
            interrupted = True
            _stop(runner, {s for s in schedule.running if s in futures}, futures, finished, began, run, view)
            if isinstance(exc, TerminationSignal):
                raise Interrupted("SIGTERM") from exc
            raise
        finally:
            run.close(project.graph, time.monotonic() - t0, interrupted=interrupted)
    return run


INTERRUPT_GRACE_S = 3.0  # for a stage to stop after Ctrl-C before it is abandoned
SIGNAL_CHECK_S = 0.2  # the longest the main thread waits before it runs a pending signal handler


def _next_finished(finished: queue.Queue[str]) -> str:
    """The next stage whose task run ended, waited for in slices. A signal (Ctrl-C, SIGTERM) may
    be delivered to any thread of the process, and Python runs its handler in the main thread:
    a wait without a timeout is cut short only when the signal lands on the main thread itself,
    so with every stage blocked, a Ctrl-C landing on another thread went unanswered."""
    while True:
        try:
            return finished.get(timeout=SIGNAL_CHECK_S)
        except queue.Empty:
            continue


def _stop(runner: StageRunner, running: set[str], futures: Mapping[str, Any], finished: queue.Queue[str],
          began: Mapping[str, float], run: RunRecord, view: RunView) -> None:
    """Interrupt the ``running`` stages; record each as it ends (or abandon it after the grace)."""
    runner.interrupt()
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while running and (left := deadline - time.monotonic()) > 0:
        try:
            stage = finished.get(timeout=left)
        except queue.Empty:
            break
        if stage in running:
            running.discard(stage)
            if _finish(stage, futures[stage], time.monotonic() - began[stage], run, view) is Outcome.FAILED:
                run.stages[stage].status, run.stages[stage].error = INTERRUPTED, "interrupted"
                view.interrupted(stage, run.stages[stage].duration_s)
    for stage in running:  # blocked in a call that cannot be interrupted: its outs go back now
        runner.abandon(stage)
        record = run.stages[stage]
        record.status, record.finished = INTERRUPTED, now().isoformat()
        record.duration_s = round(time.monotonic() - began[stage], 3)
        record.error = (f"interrupted: still blocked after {INTERRUPT_GRACE_S:.0f}s in a call that cannot be "
                        "interrupted; its previous outs were put back and it ended with the run")
        view.interrupted(stage, record.duration_s)


def _fail_task_run(future: Any, message: str) -> None:
    """Tell Prefect a stage abandoned at its timeout failed: its thread, still blocked, never will
    (the run ends without it), and its task run would stay Running in the UI for good."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(future.task_run_id, Failed(message=message), force=True)
    except Exception as exc:  # noqa: BLE001 - the record and the console say it already
        log.debug("could not mark the task run of an abandoned stage failed: %s", exc)


def _finish(stage: str, future: Any, seconds: float, run: RunRecord, view: RunView,
            abandoned: BaseException | None = None) -> Outcome:
    """Record how ``stage`` ended: its task run's result, or why it was ``abandoned`` (still running)."""
    try:
        result = abandoned or future.result(raise_on_failure=False)
    except BaseException as exc:  # noqa: BLE001 - a crashed task run (interrupted) raises its exception here
        result = exc
    record = run.stages[stage]
    record.finished, record.duration_s = now().isoformat(), round(seconds, 3)
    if isinstance(result, BaseException) or result is None:
        outcome = Outcome.FAILED
        record.error = short_error(result) if isinstance(result, BaseException) else "crashed"
    else:
        outcome = Outcome(result)
    record.status = outcome.value
    view.finished(stage, outcome, seconds, record.error or record.reason)
    return outcome


# Sessions that `conveyor run` opened (and planned) before starting its flow, by run id:
# the flow runs under the very session that decided something is due.
_PREPARED: dict[str, RunSession] = {}


def pipeline_run_name() -> str:
    """``<pipeline>-<date>-<time>``: a flow run name for a flow with a ``spec`` parameter."""
    params = flow_run.parameters
    prepared = _PREPARED.get(str(params.get("run_id")))
    if prepared is not None:  # `conveyor run` loaded the project already
        return f"{prepared.project.pipeline.pipeline}-{now():%Y%m%d-%H%M%S}"
    try:
        project = load_project(resolve_spec(Path(params.get("spec") or "configs/pipeline.yaml")))
        return f"{project.pipeline.pipeline}-{now():%Y%m%d-%H%M%S}"
    except Exception:  # noqa: BLE001 - a name must never fail the run
        return "conveyor"


def _summary_markdown(run: RunRecord) -> str:
    rows = [f"| {n} | {s.status} | {s.duration_s:.1f} | {s.where} | {s.attempts} | "
            f"{(s.error or s.reason).replace('|', '/')} |" for n, s in run.stages.items()]
    return "\n".join([
        f"# {run.pipeline}: {run.status}", "",
        "| stage | status | duration (s) | profile | attempts | reason |", "|---|---|---|---|---|---|",
        *rows, "",
        f"critical path: {' → '.join(run.critical_path)} ({run.critical_path_s:.1f}s); "
        f"wall {run.wall_s:.1f}s; speedup {run.speedup:.2f}x",
    ])


def run_stages(spec: str = "configs/pipeline.yaml", *, stages: Sequence[str] | None = None,
               downstream: bool = False, force: bool = False, profile: Mapping[str, str] | None = None,
               single_item: bool = False, run_id: str | None = None,
               set_params: Sequence[str] | None = None) -> State[Any]:
    """Inside a Prefect flow: run the pipeline of ``spec`` (or a selection), each stage a task run.

    ``stages``, ``downstream``, ``force``, ``profile`` and ``single_item`` mean what
    ``conveyor run`` means by them, ``set_params`` (``["train.eta=0.3"]``) what its ``-S``
    means; ``run_id`` names the run record (default: a new id).
    Returns the flow run's end state (Failed when a stage failed), carrying the run record.
    """
    prepared = _PREPARED.pop(run_id, None) if run_id else None
    if prepared is not None:
        return final_state(run_in_flow(prepared.project, prepared.options, run_id, session=prepared))
    project = load_project(resolve_spec(Path(spec)))
    if single_item and not stages:
        raise UsageError("single_item runs only the stages you name: pass stages")
    options = RunOptions(tuple(stages or ()), downstream, force, dict(profile or {}), single=single_item)
    check_options(project, options)
    changes = parse_overrides(set_params or [], project.root, project.params_path)
    if changes:  # written into the params file, as `conveyor run -S` and `dvc exp run -S` do
        with run_lock(project.root):
            write_overrides(changes)
        for change in changes:
            _warn(f"-S set {describe(change, project.root)}")
        project = load_project(project.spec_path)
        options = replace(options, overrides={c.shown: c.new for c in changes})
    options = replace(options, stages=tuple(project.expand(options.stages)))  # a matrix group: its items
    return final_state(run_in_flow(project, options, run_id))


@json_flow(name="conveyor-pipeline", flow_run_name=pipeline_run_name, persist_result=False, log_prints=True,
           task_runner=StageTaskRunner())
def pipeline_flow(spec: str = "configs/pipeline.yaml", stages: list[str] | None = None,
                  downstream: bool = False, force: bool = False,
                  profile: dict[str, str] | None = None, single_item: bool = False,
                  run_id: str | None = None, set_params: list[str] | None = None) -> State[Any]:
    """Run a conveyor pipeline: :func:`run_stages` as a flow (``conveyor run`` runs this one)."""
    return run_stages(spec, stages=stages, downstream=downstream, force=force, profile=profile,
                      single_item=single_item, run_id=run_id, set_params=set_params)


def run_in_flow(project: Project, options: RunOptions, run_id: str | None = None,
                session: RunSession | None = None) -> RunRecord:
    """Inside a flow run: execute, write the run record, publish the summary artifact.

    ``session``: one already open and planned (``conveyor run``); else one is opened here.
    """
    if session is None:  # a flow of the user's (a deployment's, retrain): what its tasks left running ends here
        run_id = run_id or new_run_id()
        with ended_after(_warn, new_only=True), marked(run_id, project.root), \
                open_session(project, options, warn=_warn) as opened:
            return run_in_flow(project, options, run_id, session=opened)
    run = begin(project, session.selected, run_id, options.overrides, flow_run_id=str(flow_run.id or ""),
                flow_run_url=_flow_run_url())
    run.write(project.root)  # "running": if the run is killed, the next command settles it
    try:
        with RunView(list(run.stages)) as view:
            execute(session, view, run, RunEvents(project.root, run.run_id))
    finally:
        for name, stage in run.stages.items():
            if stage.status in (Outcome.SUCCEEDED.value, Outcome.SKIPPED.value):
                stage.metrics = stage_metrics(project.root, project.metrics_of(name))
        run.write(project.root)
        # the flow may be the project's own, on Prefect's default task runner (a deployment's)
        let_go(getattr(FlowRunContext.get(), "task_runner", None), only_if_stuck=True)
    raise_if_gone()  # the record is written: a server that stopped answering gets no artifacts
    create_markdown_artifact(_summary_markdown(run), key="conveyor-run-summary",
                             description=f"conveyor run {run.run_id}")
    create_table_artifact(artifact_rows(run), key="conveyor-run-params-metrics",  # = `conveyor compare RUN`
                          description=f"params and metrics of conveyor run {run.run_id}")
    return run


def _warn(line: str) -> None:
    capture.console().print(line, style="yellow", highlight=False)


def _flow_run_url() -> str | None:
    """This flow run in Prefect's UI; None with a temporary server (it has no UI and ends with the run)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.urls import url_for

    from conveyor.prefect.server import TEMPORARY

    if not PREFECT_API_URL.value() or PREFECT_API_URL.value() in TEMPORARY or flow_run.id is None:
        return None
    return url_for("flow-run", obj_id=flow_run.id)


def final_state(run: RunRecord) -> State[Any]:
    """The flow run's end state, carrying the run record."""
    message = f"{run.pipeline}: {run.status}"
    if run.status == "failed":
        return Failed(message=f"{message}; failed: {', '.join(run.failed)}", data=run.to_dict())
    return Completed(message=message, data=run.to_dict())


def run_pipeline(session: RunSession, run_id: str) -> RunRecord:
    """Run the flow of an open, planned session in this process (``conveyor run``)."""
    options = session.options
    _PREPARED[run_id] = session
    heartbeats.unjoined()  # its end does not wait out the heartbeat thread's second
    try:
        state: State[Any] = pipeline_flow(spec=str(session.project.spec_path), stages=list(options.stages),
                                          downstream=options.downstream, force=options.force,
                                          profile=dict(options.profiles), single_item=options.single,
                                          run_id=run_id, return_state=True)
    finally:
        _PREPARED.pop(run_id, None)
    data: Any = state.result(raise_on_failure=False)
    if isinstance(data, BaseException):
        raise data
    return RunRecord.from_dict(data)
