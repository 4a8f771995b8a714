"""Deployments of conveyor's flows, and the retraining flow with champion/challenger promotion.

``prefect.yaml`` at the project root declares two deployments on a ``process`` work pool:
``pipeline`` (ad-hoc runs of :func:`conveyor.prefect.flow.pipeline_flow`) and ``retrain``
(:func:`retrain_flow` on a cron schedule). ``conveyor deploy`` creates the pool when it is
missing and registers both with ``prefect deploy --all``; ``conveyor serve`` serves the
same two from one long-lived process (Prefect's ``serve``). Both check every deployment's
parameters first, so a bad one is refused before anything is registered or runs.

Retraining: the pipeline runs with its ingest stages forced (new data, versioned by DVC
through dvc.lock) and everything else rerun only if it changed; then the challenger's
metric is compared with the champion's in the model registry (:mod:`conveyor.models.registry`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import yaml
from prefect import Flow, State, flow
from prefect.artifacts import create_markdown_artifact
from prefect.deployments.runner import RunnerDeployment
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from pydantic import Field

from conveyor.errors import ConveyorError, DeployError, UsageError
from conveyor.models import registry as reg
from conveyor.models.registry import Candidate, Direction, MetricRef, PromotionRule
from conveyor.plan.dag import overlaps
from conveyor.plan.fingerprint import Hasher, LockRecord
from conveyor.prefect.flow import RunOptions, check_options, pipeline_flow, run_in_flow
from conveyor.run.record import RunRecord, now
from conveyor.spec.project import Project, load_project, resolve_spec

PREFECT_FILE = "prefect.yaml"
PROMOTION_ARTIFACT = "conveyor-promotion"


# ---------------------------------------------------------------- the retraining flow


@dataclass(frozen=True)
class RetrainPlan:
    """A checked retraining request: what to run, how to judge it, where the registry is."""

    options: RunOptions
    rule: PromotionRule
    model: str
    registry: str


def retrain_plan(project: Project, *, ingest: Sequence[str] | None, metric: str, direction: str,
                 min_delta: float, model: str, registry: str,
                 profile: Mapping[str, str] | None = None) -> RetrainPlan:
    """Check the retraining parameters against the spec; a clear error before anything runs."""
    sources = tuple(ingest) if ingest is not None else tuple(s for s in project.order if not project.graph[s])
    options = RunOptions(forced=sources, profiles=dict(profile or {}))
    check_options(project, options)
    rule = PromotionRule(MetricRef.parse(metric), cast(Direction, direction), min_delta)  # checks direction
    problems = [p for p in (_undeclared(project, rule.metric.path, "metric file"),
                            _undeclared(project, model, "model"),
                            _registry_problem(project, registry)) if p]
    if problems:
        raise UsageError("; ".join(problems))
    return RetrainPlan(options, rule, model, registry)


def _written(project: Project) -> list[str]:
    return [p for stage in project.pipeline.stages.values() for p in stage.written]


def _undeclared(project: Project, path: str, what: str) -> str | None:
    """A problem when no stage writes ``path`` (or a directory holding it)."""
    written = _written(project)
    if any(path == w or path.startswith(w.rstrip("/") + "/") for w in written):
        return None
    return f"{what} '{path}' is not written by any stage of {project.rel(project.spec_path)} " \
           f"(outs and metrics: {', '.join(written)})"


def _registry_problem(project: Project, path: str) -> str | None:
    if Path(path).is_absolute() or ".." in Path(path).parts:
        return f"registry '{path}' must be a path inside the project"
    clash = [w for w in _written(project) if overlaps(w, path)]
    if clash:
        return f"registry '{path}' overlaps the out {clash[0]}: a stage would overwrite it; pick another path"
    return None


def _retrain_run_name() -> str:
    try:
        project = load_project(resolve_spec(Path(flow_run.parameters.get("spec") or "configs/pipeline.yaml")))
        return f"{project.pipeline.pipeline}-retrain-{now():%Y%m%d-%H%M%S}"
    except Exception:  # noqa: BLE001 - a name must never fail the run
        return "conveyor-retrain"


@flow(name="conveyor-retrain", flow_run_name=_retrain_run_name, persist_result=False, log_prints=True)
def retrain_flow(spec: str = "configs/pipeline.yaml",
                 ingest: list[str] | None = None,
                 metric: str = "metrics/test.json:stack.auc",
                 direction: Literal["max", "min"] = "max",
                 min_delta: Annotated[float, Field(ge=0)] = 0.0,
                 model: str = "models/stack.json",
                 registry: str = "models/registry.json",
                 profile: dict[str, str] | None = None) -> State[Any]:
    """Retrain: re-ingest, rerun what changed, promote the challenger only if better by ``min_delta``.

    ``ingest``: stages forced to run (default: the stages with no upstream). ``metric``:
    ``FILE:KEY`` in a metrics file a stage writes. ``model``: the out the registry keeps;
    ``registry``: the registry file (JSON, under the project root).
    """
    project = load_project(resolve_spec(Path(spec)))
    plan = retrain_plan(project, ingest=ingest, metric=metric, direction=direction, min_delta=min_delta,
                        model=model, registry=registry, profile=profile)
    run = run_in_flow(project, plan.options)
    champion, candidate = promote(project, plan, run)
    create_markdown_artifact(reg.comparison_markdown(f"{run.pipeline} retraining", plan.rule, champion, candidate),
                             key=PROMOTION_ARTIFACT, description=f"promotion decision of run {run.run_id}")
    print(f"{candidate.status}: {candidate.reason}")
    data = {"run": run.to_dict(), "candidate": asdict(candidate)}
    if candidate.status == "failed":
        return Failed(message=f"{run.pipeline}: champion kept; {candidate.reason}", data=data)
    return Completed(message=f"{run.pipeline}: {candidate.status}; {candidate.reason}", data=data)


def promote(project: Project, plan: RetrainPlan, run: RunRecord) -> tuple[Candidate | None, Candidate]:
    """Add this run's candidate to the registry; it becomes champion only if the rule says so.

    Returns the champion before, and the candidate as recorded. Any failure on the way
    (run, metric, model copy) records a ``failed`` candidate and leaves the champion as it was.
    """
    path = project.root / plan.registry
    with reg.locked(path):
        book = reg.load(path)
        candidate = _challenger(project, plan, run, book.champion)
        if candidate.status == "promoted":
            try:
                stored = reg.store_model(project.root, plan.model, path.parent / "champions" / run.run_id)
                candidate = replace(candidate, stored=stored)
            except (OSError, ConveyorError) as exc:
                candidate = replace(candidate, status="failed", reason=f"copying the model failed: {exc}")
        reg.save(path, book.add(candidate))
    return book.champion, candidate


def _challenger(project: Project, plan: RetrainPlan, run: RunRecord, champion: Candidate | None) -> Candidate:
    locked = locked_outs(project)
    sources = [o for s in plan.options.forced for o in project.pipeline.stages[s].written]
    model_md5 = locked.get(plan.model) or _md5(project.root, plan.model)
    base = Candidate(run_id=run.run_id, time=now().isoformat(), status="failed", reason="",
                     metric=str(plan.rule.metric), model=plan.model, model_md5=model_md5,
                     data_version={o: m for o in sources if (m := locked.get(o) or _md5(project.root, o))},
                     git_commit=git_commit(project.root), flow_run_id=run.flow_run_id or None)
    if run.status != "succeeded":
        broken = ", ".join(run.failed) or ", ".join(run.not_run)
        return replace(base, reason=f"the run failed ({broken}): nothing to compare")
    try:
        value, numbers = reg.read_metrics(project.root, plan.rule.metric)
    except ConveyorError as exc:
        return replace(base, reason=str(exc))
    decision = reg.decide(plan.rule, value, champion)
    return replace(base, status="promoted" if decision.promote else "rejected", reason=decision.reason,
                   value=value, metrics=numbers)


def locked_outs(project: Project) -> dict[str, str]:
    """md5 of every out at its last success: from dvc.lock under DVC, else conveyor's own lock."""
    from conveyor.dvc.compile import compiled_from

    if compiled_from(project):
        data = yaml.safe_load((project.root / "dvc.lock").read_text(encoding="utf-8")) \
            if (project.root / "dvc.lock").exists() else None
        stages = (data or {}).get("stages", {})
    else:
        stages = LockRecord.for_project(project).stages()
    return {o["path"]: o["md5"] for body in stages.values() for o in body.get("outs", []) if "md5" in o}


def _md5(root: Path, rel: str) -> str | None:
    entry = Hasher().entry(root, rel)
    return entry.md5 if entry is not None else None


def git_commit(root: Path) -> str | None:
    """The commit checked out at ``root``; None outside a git repository."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


# ---------------------------------------------------------------- prefect.yaml


@dataclass(frozen=True)
class DeploymentEntry:
    """One item of prefect.yaml's ``deployments:`` (the keys conveyor reads)."""

    name: str
    entrypoint: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    schedules: Sequence[Mapping[str, Any]] = ()
    work_pool: Mapping[str, Any] = field(default_factory=dict)
    description: str | None = None
    tags: Sequence[str] = ()
    paused: bool | None = None
    concurrency_limit: int | None = None
    enforce_parameter_schema: bool = True


def read_prefect_yaml(root: Path) -> list[DeploymentEntry]:
    """The deployments declared in ``root/prefect.yaml``."""
    path = root / PREFECT_FILE
    if not path.is_file():
        raise DeployError(f"no {PREFECT_FILE} in {root}: conveyor deploys the deployments declared there "
                          "(copy the one in conveyor's repository and adapt its parameters)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise DeployError(f"{path} is not valid YAML: {exc}") from exc
    items = data.get("deployments") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise DeployError(f"{path} declares no deployments (a 'deployments:' list)")
    return [_entry(path, i, item) for i, item in enumerate(items)]


def _entry(path: Path, index: int, item: Any) -> DeploymentEntry:
    if not isinstance(item, dict) or not item.get("name") or not item.get("entrypoint"):
        raise DeployError(f"{path} deployments.{index}: needs at least 'name' and 'entrypoint'")
    try:
        return DeploymentEntry(
            name=str(item["name"]), entrypoint=str(item["entrypoint"]),
            parameters=dict(item.get("parameters") or {}), schedules=list(item.get("schedules") or []),
            work_pool=dict(item.get("work_pool") or {}), description=item.get("description"),
            tags=list(item.get("tags") or []), paused=item.get("paused"),
            concurrency_limit=item.get("concurrency_limit"),
            enforce_parameter_schema=bool(item.get("enforce_parameter_schema", True)))
    except (TypeError, ValueError) as exc:
        raise DeployError(f"{path} deployments.{index} ({item['name']}): {exc}") from exc


def check_entry(root: Path, entry: DeploymentEntry) -> Flow[..., Any]:
    """The entry's flow, once its parameters passed Prefect's type checks and conveyor's own."""
    from prefect.exceptions import PrefectException
    from prefect.flows import load_flow_from_entrypoint

    where = f"{PREFECT_FILE} deployment '{entry.name}'"
    try:
        target: Flow[..., Any] = load_flow_from_entrypoint(entry.entrypoint, use_placeholder_flow=False)
    except Exception as exc:  # import errors of any kind, reported in one line
        raise DeployError(f"{where}: cannot load entrypoint {entry.entrypoint}: {exc}") from exc
    try:
        params = target.validate_parameters(dict(entry.parameters))
        if target.name in (pipeline_flow.name, retrain_flow.name):
            _check_conveyor_params(root, target, params)
    except (ConveyorError, PrefectException) as exc:  # conveyor's checks; Prefect's ParameterTypeError
        raise DeployError(f"{where}: {exc}") from exc
    return target


def _check_conveyor_params(root: Path, target: Flow[..., Any], params: Mapping[str, Any]) -> None:
    """conveyor's own checks of a pipeline or retrain deployment's parameters (defaults filled in)."""
    import inspect

    bound = inspect.signature(target.fn).bind_partial(**params)
    bound.apply_defaults()
    args = bound.arguments
    project = load_project(resolve_spec(Path(args["spec"]), cwd=root))
    if target.name == pipeline_flow.name:
        check_options(project, RunOptions(tuple(args["stages"] or ()), args["downstream"], args["force"],
                                          dict(args["profile"] or {})))
        return
    retrain_plan(project, ingest=args["ingest"], metric=args["metric"], direction=args["direction"],
                 min_delta=args["min_delta"], model=args["model"], registry=args["registry"],
                 profile=args["profile"])


def schedules_of(entry: DeploymentEntry) -> list[Any]:
    """prefect.yaml schedule items (cron, interval or rrule) as Prefect schedule objects."""
    from datetime import datetime, timedelta

    from prefect.schedules import Cron, Interval, RRule

    built = []
    for item in entry.schedules:
        common: dict[str, Any] = {"timezone": item.get("timezone"), "active": item.get("active", True),
                                  "parameters": item.get("parameters") or {}, "slug": item.get("slug")}
        if "cron" in item:
            built.append(Cron(str(item["cron"]), day_or=item.get("day_or", True), **common))
        elif "interval" in item:
            anchor = item.get("anchor_date")
            built.append(Interval(timedelta(seconds=float(item["interval"])),
                                  anchor_date=datetime.fromisoformat(str(anchor)) if anchor else None, **common))
        elif "rrule" in item:
            built.append(RRule(str(item["rrule"]), **common))
        else:
            raise DeployError(f"{PREFECT_FILE} deployment '{entry.name}': a schedule needs cron, interval or rrule")
    return built


# ---------------------------------------------------------------- deploy and serve


def require_api() -> str:
    """The Prefect API URL, once it answers; deployments on a throwaway server would vanish."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("no Prefect API: start a server (`prefect server start`) and point conveyor at it "
                          "(`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`)")
    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        raise DeployError(f"the Prefect API at {url} does not answer ({failure}): is `prefect server start` running?")
    return str(url)


def ensure_pools(entries: Sequence[DeploymentEntry]) -> list[str]:
    """Create each named work pool that is missing, as a ``process`` pool; returns the ones created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    created = []
    names = dict.fromkeys(str(e.work_pool["name"]) for e in entries if e.work_pool.get("name"))
    with get_client(sync_client=True) as client:
        for name in (n for n in names if "{{" not in n):  # a templated name is prefect deploy's to resolve
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                try:
                    client.create_work_pool(WorkPoolCreate(
                        name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
                    created.append(name)
                except ObjectAlreadyExists:
                    pass  # created meanwhile by someone else: just as good
    return created


def deploy_all(root: Path) -> None:
    """``conveyor deploy``: check, create missing pools, then ``prefect deploy --all`` at the root.

    Run from the root, ``prefect deploy`` records it as the flow runs' working directory.
    """
    require_api()
    entries = read_prefect_yaml(root)
    missing = [e.name for e in entries if not e.work_pool.get("name")]
    if missing:
        raise DeployError(f"{PREFECT_FILE}: deployment(s) {', '.join(missing)} name no work pool "
                          "(work_pool: {name: conveyor}); or run them with `conveyor serve`")
    for entry in entries:
        check_entry(root, entry)
    for name in ensure_pools(entries):
        print(f"created process work pool '{name}'")
    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                           "--prefect-file", str(root / PREFECT_FILE)], cwd=root, check=False)
    if done.returncode != 0:
        raise DeployError(f"`prefect deploy --all` failed (exit {done.returncode}): see its output above")
    pools = sorted({str(e.work_pool["name"]) for e in entries})
    print(f"registered {len(entries)} deployment(s); run them with: prefect worker start --pool {pools[0]}")


def serve_all(root: Path, limit: int = 1) -> None:
    """``conveyor serve``: serve every prefect.yaml deployment from this process until stopped.

    Runs start in ``root`` (the working directory of the flow runs); ``limit`` runs at once
    (one by default: the runs of a project share its workspace).
    """
    from prefect import serve

    require_api()
    entries = read_prefect_yaml(root)
    os.chdir(root)  # file entrypoints are relative to it, and served runs start in it
    serve(*(_served(root, entry) for entry in entries), limit=limit)


def _served(root: Path, entry: DeploymentEntry) -> RunnerDeployment:
    """The prefect.yaml entry as a deployment for ``serve`` (no work pool, no pull steps)."""
    from prefect.types.entrypoint import EntrypointType

    target = check_entry(root, entry)
    kind = EntrypointType.FILE_PATH if ":" in entry.entrypoint else EntrypointType.MODULE_PATH
    deployment = target.to_deployment(
        name=entry.name, parameters=dict(entry.parameters), schedules=schedules_of(entry),
        description=entry.description, tags=list(entry.tags), paused=entry.paused,
        concurrency_limit=entry.concurrency_limit, enforce_parameter_schema=entry.enforce_parameter_schema,
        entrypoint_type=kind)
    if not isinstance(deployment, RunnerDeployment):  # to_deployment is awaitable only in async code
        raise DeployError(f"{PREFECT_FILE} deployment '{entry.name}': could not be built for serving")
    return deployment
