"""The pipeline as a Prefect flow: one Prefect task per stage, submitted when its upstream succeeded.

The scheduling loop lives here once: :class:`conveyor.plan.dag.Schedule` says which stages may
start, each becomes a Prefect task on the flow's thread-pool task runner, and a finished
future is an event that may release its dependents. Independent branches therefore run
at the same time; a failure stops only what depends on it.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prefect import State, flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from conveyor.cli.view import RunView
from conveyor.dvc.record import open_record
from conveyor.errors import UsageError
from conveyor.plan import dag
from conveyor.plan.fingerprint import Record
from conveyor.run.journal import RECOVERED, Journal
from conveyor.run.metrics import stage_metrics
from conveyor.run.profiles import Profiles
from conveyor.run.record import RunRecord, StageRecord, new_run_id, now
from conveyor.run.schedule import Outcome, Schedule
from conveyor.run.stage import StageRunner, short_error
from conveyor.spec.project import Project, load_project, resolve_spec
from conveyor.workspace import run_lock

log = logging.getLogger("conveyor")
# stages with no profile run in the runner's own process tree: as many at once as there are cores
LOCAL_STAGES = os.cpu_count() or 1


@dataclass(frozen=True)
class RunOptions:
    """What to run: a selection of stages (``dvc repro`` semantics), forced or not."""

    stages: tuple[str, ...] = ()
    downstream: bool = False
    force: bool = False
    profiles: Mapping[str, str] = field(default_factory=dict)
    forced: tuple[str, ...] = ()  # run these even when up to date (retraining re-ingests)
    single: bool = False  # the named stages alone, not their upstream (dvc repro -s)

    def selected(self, graph: dag.Graph) -> set[str]:
        return dag.select(graph, self.stages, downstream=self.downstream, single=self.single)


@dataclass(frozen=True)
class ForcedRecord:
    """A record that calls ``forced`` stages stale whatever their fingerprint; the rest as ``inner`` says."""

    inner: Record
    forced: frozenset[str]

    def session(self) -> AbstractContextManager[Any]:
        return self.inner.session()

    def reasons(self, stage: str) -> list[str]:
        return ["forced"] if stage in self.forced else self.inner.reasons(stage)

    def prepare(self, stage: str) -> None:
        self.inner.prepare(stage)

    def restore(self, stage: str) -> bool:
        return stage not in self.forced and self.inner.restore(stage)

    def save(self, stage: str) -> None:
        self.inner.save(stage)


def check_options(project: Project, options: RunOptions) -> None:
    """Unknown stages or profiles in ``options``: a UsageError before anything runs."""
    project.expand([*options.stages, *options.forced])  # raises on unknown stage names
    Profiles(project.pipeline.profiles, options.profiles)  # raises on unknown profile names


def _stage_task(stage: str, runner: StageRunner) -> str:
    return runner(stage).value


def execute(project: Project, options: RunOptions, view: RunView, run: RunRecord) -> RunRecord:
    """Run the selected stages, each as soon as its upstream succeeded; fills ``run``."""
    local = {stage: "local" for stage, spec in project.pipeline.stages.items() if spec.on is None}
    schedule = Schedule(project.graph, options.selected(project.graph), order=project.order,
                        pool_of=local, limits={"local": LOCAL_STAGES})
    events: queue.Queue[str] = queue.Queue()
    futures: dict[str, Any] = {}
    began: dict[str, float] = {}
    t0 = time.monotonic()
    record: Record = open_record(project)
    if options.forced:
        record = ForcedRecord(record, frozenset(options.forced))
    with run_lock(project.root), record.session(), \
            Profiles(project.pipeline.profiles, options.profiles) as profiles:
        for warning in profiles.check({project.pipeline.stages[s].on for s in schedule.order}):
            view.console.print(f"[bold yellow]WARNING[/] {warning}")
        for stage in Journal(project.root).recover():
            view.console.print(RECOVERED.format(stage=stage), style="yellow", highlight=False)
        runner = StageRunner(project, profiles, options.force, run, view, record)

        def submit(stage: str) -> None:
            spec = project.pipeline.stages[stage]
            prefect_task = task(name=stage, task_run_name=stage, retries=spec.retries,
                                retry_delay_seconds=spec.retry_delay_s,
                                # a command enforces its own timeout: it kills its process group
                                timeout_seconds=spec.timeout_s if spec.task else None,
                                cache_policy=NO_CACHE, persist_result=False)(_stage_task)
            began[stage] = time.monotonic()
            futures[stage] = prefect_task.submit(stage, runner)
            futures[stage].add_done_callback(lambda _f: events.put(stage))

        try:
            for stage in schedule.ready():
                submit(stage)
            while not schedule.finished:
                stage = events.get()
                outcome = _finish(stage, futures[stage], time.monotonic() - began[stage], run, view)
                for lost in schedule.finish(stage, outcome):
                    run.stages[lost].reason = f"upstream '{stage}' failed"
                    view.finished(lost, Outcome.NOT_RUN, 0.0, run.stages[lost].reason)
                for ready in schedule.ready():
                    submit(ready)
        except KeyboardInterrupt:
            for stage in runner.interrupt():
                run.stages[stage].status, run.stages[stage].error = Outcome.FAILED.value, "interrupted"
            raise
        finally:
            run.close(project.graph, time.monotonic() - t0)
    return run


def _finish(stage: str, future: Any, seconds: float, run: RunRecord, view: RunView) -> Outcome:
    result = future.result(raise_on_failure=False)
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


def pipeline_run_name() -> str:
    """``<pipeline>-<date>-<time>``: a flow run name for a flow with a ``spec`` parameter."""
    params = flow_run.parameters
    try:
        project = load_project(resolve_spec(Path(params.get("spec") or "configs/pipeline.yaml")))
        return f"{project.pipeline.pipeline}-{now():%Y%m%d-%H%M%S}"
    except Exception:  # noqa: BLE001 - a name must never fail the run
        return "conveyor"


def resume_command(project: Project, run: RunRecord) -> str | None:
    """The command that re-runs what failed and everything after it."""
    if not run.failed:
        return None
    return f"conveyor run{project.spec_option} {' '.join(run.failed)} --downstream"


def _summary_markdown(run: RunRecord) -> str:
    rows = [f"| {n} | {s.status} | {s.duration_s:.1f} | {s.profile or ''} | {s.attempts} | "
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
               single_item: bool = False, run_id: str | None = None) -> State[Any]:
    """Inside a Prefect flow: run the pipeline of ``spec`` (or a selection), each stage a task run.

    ``stages``, ``downstream``, ``force``, ``profile`` and ``single_item`` mean what
    ``conveyor run`` means by them; ``run_id`` names the run record (default: a new id).
    Returns the flow run's end state (Failed when a stage failed), carrying the run record.
    """
    project = load_project(resolve_spec(Path(spec)))
    if single_item and not stages:
        raise UsageError("single_item runs only the stages you name: pass stages")
    options = RunOptions(tuple(stages or ()), downstream, force, dict(profile or {}), single=single_item)
    check_options(project, options)
    options = replace(options, stages=tuple(project.expand(options.stages)))  # a matrix group: its items
    return final_state(run_in_flow(project, options, run_id))


@flow(name="conveyor-pipeline", flow_run_name=pipeline_run_name, persist_result=False, log_prints=True)
def pipeline_flow(spec: str = "configs/pipeline.yaml", stages: list[str] | None = None,
                  downstream: bool = False, force: bool = False,
                  profile: dict[str, str] | None = None, single_item: bool = False,
                  run_id: str | None = None) -> State[Any]:
    """Run a conveyor pipeline: :func:`run_stages` as a flow (``conveyor run`` runs this one)."""
    return run_stages(spec, stages=stages, downstream=downstream, force=force, profile=profile,
                      single_item=single_item, run_id=run_id)


def run_in_flow(project: Project, options: RunOptions, run_id: str | None = None) -> RunRecord:
    """Inside a flow run: execute, write the run record, publish the summary artifact."""
    run = RunRecord(run_id or new_run_id(), project.pipeline.pipeline, flow_run_id=str(flow_run.id or ""),
                    flow_run_url=_flow_run_url())
    selected = options.selected(project.graph)
    run.stages = {s: StageRecord() for s in project.order if s in selected}
    try:
        with RunView(list(run.stages)) as view:
            execute(project, options, view, run)
    finally:
        for name, stage in run.stages.items():
            if stage.status in (Outcome.SUCCEEDED.value, Outcome.SKIPPED.value):
                stage.metrics = stage_metrics(project.root, project.metrics_of(name))
        run.write(project.root)
    create_markdown_artifact(_summary_markdown(run), key="conveyor-run-summary",
                             description=f"conveyor run {run.run_id}")
    return run


def _flow_run_url() -> str | None:
    """This flow run in Prefect's UI; None with the embedded server, whose UI ends with the run."""
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.urls import url_for

    if not PREFECT_API_URL.value() or flow_run.id is None:
        return None
    return url_for("flow-run", obj_id=flow_run.id)


def final_state(run: RunRecord) -> State[Any]:
    """The flow run's end state, carrying the run record."""
    message = f"{run.pipeline}: {run.status}"
    if run.status == "failed":
        return Failed(message=f"{message}; failed: {', '.join(run.failed)}", data=run.to_dict())
    return Completed(message=message, data=run.to_dict())


def run_pipeline(spec: Path, options: RunOptions, run_id: str | None = None) -> RunRecord:
    """Run the flow in this process (embedded Prefect server unless PREFECT_API_URL is set)."""
    state: State[Any] = pipeline_flow(spec=str(spec), stages=list(options.stages), downstream=options.downstream,
                                      force=options.force, profile=dict(options.profiles),
                                      single_item=options.single, run_id=run_id, return_state=True)
    data: Any = state.result(raise_on_failure=False)
    if isinstance(data, BaseException):
        raise data
    return RunRecord.from_dict(data)
