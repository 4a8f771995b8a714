"""``conveyor dag --format html``: one self-contained page, the DAG laid out, each stage coloured by its state.

What it shows comes from records that exist already: the status question (what is stale and
why, asked as ``conveyor status`` asks it) and the run records (the last run's failures and
critical path; each stage's last duration and profile, from the newest run that ran it).
The page is an inline SVG drawn here over :mod:`conveyor.plan.layout`, the template
``dag_page.html`` (its CSS, and a little JavaScript for a stage's details on click and a
search box), and the stages' details as JSON in the page: nothing is fetched. All text is
escaped, the JSON too (a ``</script>`` in a reason cannot end its script).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from html import escape
from importlib.resources import files
from itertools import chain, pairwise
from string import Template

from conveyor.plan.layout import Layout, Node, layered
from conveyor.run.record import RunRecord, StageRecord, parse_record, runs_dir
from conveyor.spec.project import Project

UP_TO_DATE, STALE, NEVER_RUN, FAILED = "up to date", "stale", "never run", "failed in the last run"
STATES = (UP_TO_DATE, STALE, NEVER_RUN, FAILED)
RAN = ("succeeded", "failed", "interrupted")  # a run "ran" a stage it did not skip
RUNS_READ = 200  # past run records read for the stages' last durations, newest first

CHAR_W, NODE_H, ROW_H, GAP_X, PAD, MAX_LABEL = 7.2, 26, 38, 70, 16, 40  # pixels; MAX_LABEL in characters


@dataclass(frozen=True, slots=True)
class StageView:
    """What the page says of one stage."""

    state: str
    reasons: list[str]
    upstream: list[str]
    duration: str | None = None  # of the newest run that ran it
    profile: str | None = None  # where it ran then, else its declared profile
    run_id: str | None = None
    error: str | None = None  # why it failed in the last run
    critical: bool = False  # on the last run's critical path


def dag_page(project: Project, reasons: Mapping[str, list[str]]) -> str:
    """The page of ``project`` given ``reasons`` (``conveyor status``'s answer) and its run records."""
    runs = _newest_runs(project)  # read lazily: only as far back as the stages' last runs
    latest = next(runs, None)
    views = stage_views(project, reasons, latest, chain([latest], runs) if latest is not None else ())
    return page(project, views, latest.critical_path if latest is not None else [])


def stage_views(project: Project, reasons: Mapping[str, list[str]], latest: RunRecord | None,
                runs: Iterable[RunRecord]) -> dict[str, StageView]:
    """Each stage's view from ``reasons``, the ``latest`` run and ``runs`` (this spec's, newest
    first). "Failed" only while the failure stands: a stage that failed in the last run and is
    up to date now was run since (by ``dvc repro``, or ``conveyor exec``)."""
    last = _last_ran(runs, set(project.order))
    rank = {stage: i for i, stage in enumerate(project.order)}
    views: dict[str, StageView] = {}
    for stage in project.order:
        why = reasons.get(stage, [])
        failed = latest.stages.get(stage) if latest is not None else None
        failed = failed if failed is not None and failed.status == "failed" and why else None
        state = FAILED if failed else NEVER_RUN if "never run" in why else STALE if why else UP_TO_DATE
        record, run_id = last.get(stage, (None, None))
        views[stage] = StageView(
            state, list(why), sorted(project.graph[stage], key=rank.__getitem__),
            duration=f"{record.duration_s:.1f}s" if record is not None else None,
            profile=record.where if record is not None else project.pipeline.stages[stage].on,
            run_id=run_id, error=failed.error if failed else None,
            critical=latest is not None and stage in latest.critical_path)
    return views


def _last_ran(runs: Iterable[RunRecord], stages: set[str]) -> dict[str, tuple[StageRecord, str]]:
    """For each stage, its record in the newest of ``runs`` that ran it, and that run's id."""
    found: dict[str, tuple[StageRecord, str]] = {}
    for run in runs:
        for name, record in run.stages.items():
            if name in stages and name not in found and record.status in RAN:
                found[name] = (record, run.run_id)
        if len(found) == len(stages):
            break
    return found


def _newest_runs(project: Project) -> Iterator[RunRecord]:
    """The run records of this spec, newest first (run ids start with their UTC time), the unreadable
    left out; records older than their ``spec`` field count as the default spec's (as ``conveyor runs``)."""
    folder = runs_dir(project.root)
    paths = sorted((p for p in folder.glob("*.json") if p.name != "latest.json"), reverse=True) \
        if folder.is_dir() else []
    spec = project.rel(project.spec_path)
    for path in paths[:RUNS_READ]:
        try:
            run = parse_record(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if run.spec == spec or (not run.spec and not project.spec_option):
            yield run


def page(project: Project, views: Mapping[str, StageView], critical_path: Sequence[str]) -> str:
    """The whole page: the laid-out DAG as SVG, its legend and summary, the stages' details."""
    layout = layered(project.graph, project.order)
    counts = {state: sum(v.state == state for v in views.values()) for state in STATES}
    legend = "".join(f'<span><i class="{_css(s)}"></i>{escape(s)} ({counts[s]})</span>' for s in STATES)
    legend += '<span><b class="cp"></b>critical path of the last run</span>'
    stale = [s for s, v in views.items() if v.state != UP_TO_DATE]
    summary = (f"{len(views)} stages; {len(stale)} would run: {escape(', '.join(stale[:8]))}"
               f"{' ...' if len(stale) > 8 else ''}" if stale else f"{len(views)} stages, all up to date")
    data = json.dumps({s: asdict(v) for s, v in views.items()}, ensure_ascii=True).replace("<", "\\u003c")
    template = Template(files("conveyor.cli").joinpath("dag_page.html").read_text(encoding="utf-8"))
    title = f"{project.pipeline.pipeline}: the DAG ({project.rel(project.spec_path)})"
    return template.substitute(title=escape(title), legend=legend, summary=summary, data=data,
                               svg=dag_svg(layout, views, critical_path))


def _css(state: str) -> str:
    return {FAILED: "failed"}.get(state, state.replace(" ", "-"))


def dag_svg(layout: Layout, views: Mapping[str, StageView], critical_path: Sequence[str] = ()) -> str:
    """The layout drawn: a column per layer, boxes for stages, curves for edges (through their bends);
    the edges between consecutive stages of ``critical_path`` marked."""
    boxes = _boxes(layout)
    critical = set(pairwise(critical_path))
    width = max((x + w for x, _, w in boxes.values()), default=0) + PAD
    height = max((y + NODE_H for _, y, _ in boxes.values()), default=0) + PAD
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="system-ui, sans-serif">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerUnits="userSpaceOnUse" '
             'markerWidth="9" markerHeight="9" orient="auto-start-reverse">'
             '<path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>']
    for up, down in layout.edges:
        css = "edge critical" if (up, down) in critical else "edge"
        parts.append(f'<path class="{css}" data-up="{escape(up)}" data-down="{escape(down)}" '
                     f'd="{_curve(layout.path(up, down), boxes)}" marker-end="url(#arrow)"/>')
    for stage, view in views.items():
        parts.append(_stage_box(stage, view, boxes[stage]))
    parts.append("</svg>")
    return "\n".join(parts)


def _boxes(layout: Layout) -> dict[Node, tuple[float, float, float]]:
    """Each node's (x, y, width): columns as wide as their longest label, each centred on the tallest."""
    tallest = max((len(layer) for layer in layout.layers), default=0)
    boxes: dict[Node, tuple[float, float, float]] = {}
    x = float(PAD)
    for layer in layout.layers:
        labels = [len(_label(n)) for n in layer if isinstance(n, str)]
        width = max(labels, default=0) * CHAR_W + 20 if labels else 20.0
        top = PAD + (tallest - len(layer)) * ROW_H / 2
        for row, node in enumerate(layer):
            boxes[node] = (x, top + row * ROW_H, width)
        x += width + GAP_X
    return boxes


def _label(stage: str) -> str:
    return stage if len(stage) <= MAX_LABEL else stage[:MAX_LABEL - 1] + "…"


def _curve(path: Sequence[Node], boxes: Mapping[Node, tuple[float, float, float]]) -> str:
    """An SVG path from the right of the first box to the left of the last: an S-curve between
    columns, a straight run across each column it passes by a bend."""
    mid = NODE_H / 2
    x0, y0, w0 = boxes[path[0]]
    d = [f"M {x0 + w0:.1f} {y0 + mid:.1f}"]
    at = (x0 + w0, y0 + mid)
    for node in path[1:]:
        x, y, w = boxes[node]
        half = (x - at[0]) / 2
        d.append(f"C {at[0] + half:.1f} {at[1]:.1f} {x - half:.1f} {y + mid:.1f} {x:.1f} {y + mid:.1f}")
        if isinstance(node, tuple):
            d.append(f"L {x + w:.1f} {y + mid:.1f}")
        at = (x + w, y + mid)
    return " ".join(d)


def _stage_box(stage: str, view: StageView, box: tuple[float, float, float]) -> str:
    """A stage as a box: its state's colour, its name, and on hover (the SVG title) its state and why."""
    x, y, w = box
    css = f"stage {_css(view.state)}" + (" critical" if view.critical else "")
    hover = "; ".join([f"{stage}: {view.state}", *view.reasons[:6],
                       *([f"last {view.duration} on {view.profile}"] if view.duration else [])])
    return (f'<g class="{css}" data-stage="{escape(stage)}" data-state="{escape(view.state)}" tabindex="0">'
            f"<title>{escape(hover)}</title>"
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{NODE_H}"/>'
            f'<text x="{x + 10:.1f}" y="{y + NODE_H / 2 + 4:.1f}">{escape(_label(stage))}</text></g>')
