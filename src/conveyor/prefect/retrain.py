"""Retraining with champion/challenger promotion, inside any Prefect flow.

The pipeline runs with its ingest stages forced (new data, versioned by DVC through
dvc.lock) and everything else rerun only if it changed; then the challenger's metric is
compared with the champion's in the model registry (:mod:`conveyor.models.registry`), and
the challenger is promoted only if it is better by the margin.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, cast

from prefect import State, flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from pydantic import Field

from conveyor.errors import ConveyorError, UsageError
from conveyor.models import registry as reg
from conveyor.models.registry import Candidate, Direction, MetricRef, PromotionRule
from conveyor.plan.dag import overlaps
from conveyor.prefect.flow import run_in_flow
from conveyor.run.record import RunRecord, now
from conveyor.run.session import RunOptions, check_options
from conveyor.spec.project import Project, load_project, resolve_spec

PROMOTION_ARTIFACT = "conveyor-promotion"


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


def retrain_run_name() -> str:
    """``<pipeline>-retrain-<date>-<time>``: a flow run name for a flow with a ``spec`` parameter."""
    try:
        project = load_project(resolve_spec(Path(flow_run.parameters.get("spec") or "configs/pipeline.yaml")))
        return f"{project.pipeline.pipeline}-retrain-{now():%Y%m%d-%H%M%S}"
    except Exception:  # noqa: BLE001 - a name must never fail the run
        return "conveyor-retrain"


def retrain(spec: str = "configs/pipeline.yaml", *, metric: str, model: str, ingest: Sequence[str] | None = None,
            direction: str = "max", min_delta: float = 0.0, registry: str = "models/registry.json",
            profile: Mapping[str, str] | None = None) -> State[Any]:
    """Inside a Prefect flow: re-ingest, rerun what changed, promote the challenger only if better.

    ``metric``: ``FILE:KEY`` in a metrics file a stage writes (``metrics/test.json:auc``);
    ``direction``: ``max`` or ``min``, which is better; ``min_delta``: by how much it must be
    better. ``model``: the out the registry keeps a copy of for the champion. ``ingest``: stages
    forced to run (default: the stages with no upstream). ``registry``: the registry file (JSON,
    under the project root). Returns the flow run's end state: Failed when the run failed.
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


@flow(name="conveyor-retrain", flow_run_name=retrain_run_name, persist_result=False, log_prints=True)
def retrain_flow(metric: str,
                 model: str,
                 spec: str = "configs/pipeline.yaml",
                 ingest: list[str] | None = None,
                 direction: Literal["max", "min"] = "max",
                 min_delta: Annotated[float, Field(ge=0)] = 0.0,
                 registry: str = "models/registry.json",
                 profile: dict[str, str] | None = None) -> State[Any]:
    """Retrain any conveyor project: :func:`retrain` as a flow (a project's own flows/ may wrap it instead)."""
    return retrain(spec, metric=metric, model=model, ingest=ingest, direction=direction, min_delta=min_delta,
                   registry=registry, profile=profile)


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
                folder = path.parent / "champions" / run.run_id
                stored = reg.store_model(project.root, plan.model, folder)
                candidate = replace(candidate, stored=stored, **_model_files(project, folder))
            except (OSError, ConveyorError) as exc:
                candidate = replace(candidate, status="failed", reason=f"copying the model failed: {exc}")
        reg.save(path, book.add(candidate))
    return book.champion, candidate


def _model_files(project: Project, folder: Path) -> dict[str, Any]:
    """The spec's model files copied to their project paths under ``folder`` (what ``serve-model``
    and ``predict --model champion`` read), and their version."""
    from conveyor.predict.model import version_of

    spec = project.pipeline.model
    if spec is None:
        return {}
    files = {name: reg.store_model(project.root, rel, folder / PurePosixPath(rel).parent)
             for name, rel in spec.files.items()}
    return {"files": files, "version": version_of({n: project.root / p for n, p in files.items()})}


def _challenger(project: Project, plan: RetrainPlan, run: RunRecord, champion: Candidate | None) -> Candidate:
    locked = reg.locked_outs(project)
    model_md5 = locked.get(plan.model) or reg.md5_of(project.root, plan.model)
    base = Candidate(run_id=run.run_id, time=now().isoformat(), status="failed", reason="",
                     metric=str(plan.rule.metric), model=plan.model, model_md5=model_md5,
                     data_version=reg.data_version(project, plan.options.forced),
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


def git_commit(root: Path) -> str | None:
    """The commit checked out at ``root``; None outside a git repository."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None
