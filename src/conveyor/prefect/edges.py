"""The flow run's graph in Prefect's UI: each stage's task run connected to its upstream stages' task runs.

Prefect draws an edge into a task run from every task run its ``task_inputs`` name (all keys but
``__parents__``, which nests a run inside another). conveyor submits a stage only once its
upstream succeeded: its own loop decides, and Prefect must neither wait nor judge again. So the
upstream futures are not passed as ``wait_for`` (Prefect would wait on each and refuse to start
on a state it does not call completed); they go to the task runner as the task run's
``dependencies``, recorded under the stage task's ``upstream`` parameter, which carries the
upstream stages' names. An upstream stage with no task run in this flow run (skipped as up to
date, or outside the selection) passes the edge on to the stages it waits for in turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRunResult
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture

from conveyor.plan.dag import Graph


def upstream_runs(graph: Graph, stage: str, futures: Mapping[str, PrefectFuture[Any]]) -> dict[str, PrefectFuture[Any]]:
    """The nearest stages upstream of ``stage`` that have a task run (a future) in this flow run."""
    found: dict[str, PrefectFuture[Any]] = {}
    seen: set[str] = set()
    todo = list(graph[stage])
    while todo:
        up = todo.pop()
        if up in seen:
            continue
        seen.add(up)
        if up in futures:
            found[up] = futures[up]
        else:
            todo.extend(graph[up])
    return found


def submit_connected(task: Task[..., Any], parameters: Mapping[str, Any],
                     upstream: Mapping[str, PrefectFuture[Any]]) -> PrefectFuture[Any]:
    """Submit ``task`` on the flow run's task runner now, its task run recording the ``upstream``
    task runs as its inputs (the ``upstream`` parameter: their stages' names, sorted)."""
    context = FlowRunContext.get()
    if context is None or context.task_runner is None:
        raise RuntimeError("a stage's task run is submitted inside a flow run")
    inputs: set[Any] = {TaskRunResult(id=future.task_run_id) for future in upstream.values()}
    future: PrefectFuture[Any] = context.task_runner.submit(
        task, {**parameters, "upstream": sorted(upstream)}, dependencies={"upstream": inputs})
    return future
