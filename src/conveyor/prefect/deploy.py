"""Deployments of a project's flows: ``conveyor deploy`` and ``conveyor serve`` over ``prefect.yaml``.

``prefect.yaml`` at the project root declares the deployments, typically on a ``process``
work pool: the project's own flows in ``flows/`` (a few lines each over
:func:`conveyor.run_stages` and :func:`conveyor.retrain`), or conveyor's generic
``conveyor.prefect.flow.pipeline_flow`` and ``conveyor.prefect.retrain.retrain_flow``.
``conveyor deploy`` creates the pools that are missing and registers every deployment with
``prefect deploy --all``; ``conveyor serve`` serves them from one long-lived process
(Prefect's ``serve``). Both check every deployment's parameters first (Prefect's types, then
conveyor's: the spec, its stages, profiles and metrics), so a bad one is refused before
anything is registered or runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prefect import Flow
from prefect.deployments.runner import RunnerDeployment

from conveyor.errors import ConveyorError, DeployError
from conveyor.prefect.retrain import retrain_plan
from conveyor.run.session import RunOptions, check_options
from conveyor.spec.overrides import parse_overrides
from conveyor.spec.project import ensure_importable, load_project, resolve_spec
from conveyor.spec.yamlmap import load_yaml

PREFECT_FILE = "prefect.yaml"


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
        data = load_yaml(path).data or {}
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
    path, sep, name = entry.entrypoint.rpartition(":")
    entrypoint = f"{root / path}:{name}" if sep else entry.entrypoint  # a file of the project, from anywhere
    try:
        target: Flow[..., Any] = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    except Exception as exc:  # import errors of any kind, reported in one line
        raise DeployError(f"{where}: cannot load entrypoint {entry.entrypoint}: {exc}") from exc
    try:
        params = target.validate_parameters(dict(entry.parameters))
        _check_conveyor_params(root, target, params)
    except (ConveyorError, PrefectException) as exc:  # conveyor's checks; Prefect's ParameterTypeError
        raise DeployError(f"{where}: {exc}") from exc
    return target


def _check_conveyor_params(root: Path, target: Flow[..., Any], params: Mapping[str, Any]) -> None:
    """conveyor's own checks of a flow's parameters (defaults filled in), by their names.

    A flow with a ``spec`` parameter runs a conveyor pipeline: the spec must load, and the
    parameters :func:`conveyor.run_stages` or :func:`conveyor.retrain` take (``stages``,
    ``profile``, ``metric``, ``model``...) must fit it. Other flows are Prefect's business.
    """
    import inspect

    bound = inspect.signature(target.fn).bind_partial(**params)
    bound.apply_defaults()
    args = bound.arguments
    if not isinstance(args.get("spec"), str):
        return
    project = load_project(resolve_spec(Path(args["spec"]), cwd=root))
    if isinstance(args.get("metric"), str) and isinstance(args.get("model"), str):
        retrain_plan(project, ingest=args.get("ingest"), metric=args["metric"], direction=args.get("direction", "max"),
                     min_delta=args.get("min_delta", 0.0), model=args["model"],
                     registry=args.get("registry", "models/registry.json"), profile=args.get("profile"))
        return
    check_options(project, RunOptions(tuple(args.get("stages") or ()), bool(args.get("downstream")),
                                      bool(args.get("force")), dict(args.get("profile") or {})))
    parse_overrides(args.get("set_params") or [], project.root, project.params_path)


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
    """The prefect.yaml entry as a deployment for ``serve`` (no work pool, no pull steps).

    A file of the project (``flows/pipeline.py:pipeline``) is served by its module path
    (``flows.pipeline.pipeline``): served runs start in the project root, where it imports,
    and a module entrypoint needs no code storage. (A file entrypoint would take the
    deployment's ``path``, which Prefect leaves empty when ``conveyor deploy`` registered the
    same deployment on a work pool before.)
    """
    from prefect.flows import load_flow_from_entrypoint
    from prefect.types.entrypoint import EntrypointType

    target = check_entry(root, entry)
    module = _module_entrypoint(root, entry.entrypoint)
    if module is not None:
        ensure_importable(root)
        target = load_flow_from_entrypoint(module, use_placeholder_flow=False)
    deployment = target.to_deployment(
        name=entry.name, parameters=dict(entry.parameters), schedules=schedules_of(entry),
        description=entry.description, tags=list(entry.tags), paused=entry.paused,
        concurrency_limit=entry.concurrency_limit, enforce_parameter_schema=entry.enforce_parameter_schema,
        entrypoint_type=EntrypointType.FILE_PATH if ":" in (module or entry.entrypoint) else EntrypointType.MODULE_PATH)
    if not isinstance(deployment, RunnerDeployment):  # to_deployment is awaitable only in async code
        raise DeployError(f"{PREFECT_FILE} deployment '{entry.name}': could not be built for serving")
    return deployment


def _module_entrypoint(root: Path, entrypoint: str) -> str | None:
    """``flows/pipeline.py:pipeline`` as ``flows.pipeline.pipeline``, for a .py file inside ``root``."""
    path, sep, name = entrypoint.rpartition(":")
    file = (root / path).resolve()
    if not sep or file.suffix != ".py" or not file.is_relative_to(root.resolve()):
        return None
    parts = [*file.relative_to(root.resolve()).with_suffix("").parts, name]
    return ".".join(parts) if all(part.isidentifier() for part in parts) else None
