"""The DAG as text, Mermaid or Graphviz dot (``conveyor dag``)."""

from __future__ import annotations

from conveyor.spec.project import Project


def _label(project: Project, stage: str) -> str:
    on = project.pipeline.stages[stage].on
    return f"{stage} ({on})" if on else stage


def render_dag(project: Project, fmt: str) -> str:
    """Render the pipeline's graph; stages in dependency order."""
    order, graph = project.order, project.graph
    edges = [(up, stage) for stage in order for up in sorted(graph[stage], key=order.index)]
    if fmt == "mermaid":
        ids = {s: f"s{i}" for i, s in enumerate(order)}  # DVC's names (train@0.1-small) are not mermaid ids
        nodes = [f'    {ids[s]}["{_label(project, s)}"]' for s in order]
        return "\n".join(["flowchart TD", *nodes, *(f"    {ids[a]} --> {ids[b]}" for a, b in edges)])
    if fmt == "dot":
        nodes = [f'  "{s}" [label="{_label(project, s)}"];' for s in order]
        links = [f'  "{a}" -> "{b}";' for a, b in edges]
        return "\n".join([f'digraph "{project.pipeline.pipeline}" {{', "  rankdir=LR;", *nodes, *links, "}"])
    width = max(len(_label(project, s)) for s in order)
    lines = [f"{project.pipeline.pipeline}: {len(order)} stages"]
    for stage in order:
        ups = sorted(graph[stage], key=order.index)
        lines.append(f"  {_label(project, stage):<{width}}" + (f"  <- {', '.join(ups)}" if ups else ""))
    return "\n".join(lines)
