"""The flow run's graph in Prefect's UI connects the stages' task runs as the DAG connects them.

The DAG::

    a ──► b ──► d
    └───► c ──┘

Read back from the session's real Prefect server: the graph its UI draws (``/flow_runs/{id}/graph-v2``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from projects import Project

from conveyor.prefect.edges import upstream_runs

TASKS = '''
import json


def write(ctx):
    for path in ctx.outs.values():
        path.write_text(json.dumps({"stage": ctx.stage, "params": dict(ctx.params)}))
'''


def diamond(project: Project) -> None:
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", "a: {n: 1}\nb: {n: 2}\n")
    project.write("configs/pipeline.yaml", """
        pipeline: diamond
        stages:
          a: {task: tasks.steps:write, params: [a], outs: [out/a.txt]}
          b: {task: tasks.steps:write, params: [b], deps: [out/a.txt], outs: [out/b.txt]}
          c: {task: tasks.steps:write, deps: [out/a.txt], outs: [out/c.txt]}
          d: {task: tasks.steps:write, deps: [out/b.txt, out/c.txt], outs: [out/d.txt]}
        """)


def drawn_edges(project: Project, flow_run_id: str, expected: int, deadline_s: float = 30) -> dict[str, set[str]]:
    """Each task run of the flow run's graph, by name, and the task runs it is drawn from; once
    ``expected`` task runs have ended (the server records them from events, a moment after the run)."""
    url = f"{project.env['PREFECT_API_URL']}/flow_runs/{flow_run_id}/graph-v2"
    deadline = time.monotonic() + deadline_s
    while True:
        graph: dict[str, Any] = httpx.get(url, timeout=10).raise_for_status().json()
        nodes = dict((node_id, node) for node_id, node in graph["nodes"])
        ended = [n for n in nodes.values() if n["end_time"] is not None]
        if len(ended) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {n["label"]: {nodes[p["id"]]["label"] for p in n["parents"]} for n in nodes.values()}


@pytest.mark.slow
def test_the_flow_run_graph_connects_the_stages_as_the_dag_does(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stderr
    assert drawn_edges(project, project.record()["flow_run_id"], expected=4) == {
        "a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}}

    project.write("params.yaml", "a: {n: 1}\nb: {n: 3}\n")  # b and d run again; a and c are skipped
    second = project.conveyor("run")
    assert second.returncode == 0, second.stderr
    assert drawn_edges(project, project.record()["flow_run_id"], expected=2) == {"b": set(), "d": {"b"}}


def test_an_edge_passes_through_stages_that_have_no_task_run() -> None:
    """
    a ──► b ──► c ──► e      b and d were skipped (no task run): c is drawn from a (through b),
          └───► d ──┘        e from c and from a (through d and b)
    """
    graph = {"a": frozenset(), "b": frozenset("a"), "c": frozenset("b"), "d": frozenset("b"),
             "e": frozenset("cd")}
    futures: dict[str, Any] = {"a": "future of a", "c": "future of c"}
    assert upstream_runs(graph, "e", futures) == {"a": "future of a", "c": "future of c"}
    assert upstream_runs(graph, "c", futures) == {"a": "future of a"}
    assert upstream_runs(graph, "a", futures) == {}
