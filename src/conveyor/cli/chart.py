"""``conveyor compare --plot``: one self-contained HTML page, a small SVG chart per metric.

No JavaScript and nothing fetched: the SVG is written here, and hovering a point shows its
values through the SVG ``<title>``. Each chart plots a metric against the param that varies
across its points: a matrix item's value (``item.eta``) for items, else a param set with
``-S`` or one that differs between runs; when none does, against the order of the runs.
Every run is one colour (its series) in every chart; the points of a run that share their
other item values (``item.depth=8``) are joined by a line, labelled at its end. All text is
escaped; the SVG carries its own styling, so each chart also reads on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from conveyor.run.compare import ITEM, Row, columns_of, fmt

COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
WIDTH, HEIGHT = 780, 250
LEFT, RIGHT, TOP, BOTTOM = 56, 420, 30, 200  # the plot area; right of it, line labels, then the legend
LEGEND = RIGHT + 90
RUN_ORDER = "run (in the order compared)"
Scale = Callable[[float], float]

CSS = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; } .charts { display: flex; flex-wrap: wrap; gap: 1em; }
svg { border: 1px solid #ddd; background: #fff; } circle:hover { stroke: #000; stroke-width: 2; }
"""


@dataclass(frozen=True, slots=True)
class Point:
    row: Row
    x: Any
    y: float
    line: tuple[str, ...]  # the other varying item values, ``item.depth=8``: one line per run and value


def chart_page(rows: Sequence[Row], run_ids: Sequence[str], title: str) -> str:
    """The HTML page: a chart per metric column of ``rows``; ``run_ids`` fix each run's colour."""
    colour = {run: COLOURS[i % len(COLOURS)] for i, run in enumerate(run_ids)}
    charts = [chart_svg(metric, rows, run_ids, colour) for metric in columns_of(rows).metrics]
    body = "\n".join(charts) if charts else "<p>None of these runs recorded a metric.</p>"
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><h1>{escape(title)}</h1>\n"
            f'<div class="charts">\n{body}\n</div></body></html>\n')


def chart_svg(metric: str, rows: Sequence[Row], run_ids: Sequence[str], colour: dict[str, str]) -> str:
    """One metric against the param that varies most usefully (see the module docstring). A row
    with no value for that param is left out of the chart, and the legend says so; so is a run
    with no value of the metric (it failed, or its stage did not run): the legend lists every run
    compared, as the page's title counts them."""
    measured = [r for r in rows if metric in r.metrics and math.isfinite(r.metrics[metric])]
    key, rest = x_param(measured)
    placed = [r for r in measured if key is None or r.params.get(key) is not None]
    points = [Point(r, run_ids.index(r.run_id) + 1 if key is None else r.params[key], r.metrics[metric],
                    tuple(f"{k}={fmt(r.params.get(k))}" for k in rest)) for r in placed]
    xs = _XAxis([p.x for p in points])
    values = [p.y for p in points]
    y_ticks = nice_ticks(min(values, default=0.0), max(values, default=1.0))
    scale_y = _scale(y_ticks[0], y_ticks[-1], BOTTOM, TOP)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="system-ui, sans-serif" font-size="11" '
             f'data-metric="{escape(metric)}">',
             f'<text x="{LEFT}" y="18" font-weight="bold" font-size="12">{escape(metric)}</text>',
             *_axes(xs, key or RUN_ORDER, y_ticks, scale_y)]
    for run in run_ids:
        mine = [p for p in points if p.row.run_id == run]
        if mine:
            parts.append(_series(run, mine, metric, key, xs, scale_y, colour[run]))
    missing = {r.run_id: f"no {key}" for r in measured if r not in placed}
    missing |= {run: "no value" for run in run_ids if not any(r.run_id == run for r in measured)}
    parts += _legend(run_ids, colour, {run: why for run, why in missing.items()
                                       if not any(p.row.run_id == run for p in points)})
    parts.append("</svg>")
    return "\n".join(parts)


def x_param(rows: Sequence[Row]) -> tuple[str | None, list[str]]:
    """The param to plot against, and the other varying item values (None: the run order)."""
    def varies(key: str) -> bool:
        return len({fmt(r.params.get(key)) for r in rows}) > 1

    keys = list(dict.fromkeys(k for r in rows for k in r.params))
    items = [k for k in keys if k.startswith(ITEM) and varies(k)]
    if items:
        return items[0], items[1:]
    set_with_s = [k for k in keys if any(k in r.overridden for r in rows) and varies(k)]
    others = [k for k in keys if varies(k)]
    return next(iter(set_with_s + others), None), []


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values (steps of 1, 2 or 5 times a power of ten) spanning ``low`` to ``high``, and a little
    more; never below zero for values that are not (an error, a loss, a count has no negative axis)."""
    floor = 0.0 if low >= 0 else -math.inf
    pad = (high - low) * 0.05 or abs(low) * 0.1 or 1.0  # no point on the frame; one value: a band around it
    low, high = max(low - pad, floor), high + pad
    raw = (high - low) / (count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = max(math.floor(low / step), 0 if floor == 0 else -(2**62))
    last = math.ceil(high / step)
    return [round(i * step, 12) for i in range(first, last + 1)]


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for evenly spaced ``ticks``, with as many decimals as their step needs: no two alike
    (4 significant digits would print 0.91234 and 0.91236 both as 0.9123)."""
    if len(ticks) < 2:
        return [fmt(t) for t in ticks]
    step = abs(ticks[1] - ticks[0]) or 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return [f"{t:.{decimals}f}" for t in ticks]


class _XAxis:
    """Numbers on a linear scale; anything else as evenly spaced categories."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.numeric = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values)
        if self.numeric:
            distinct = sorted(set(values))
            self.ticks: list[Any] = distinct if 1 < len(distinct) <= 8 else nice_ticks(min(distinct, default=0),
                                                                                        max(distinct, default=1))
            self._to = _scale(min(self.ticks), max(self.ticks), LEFT + 20, RIGHT - 20)
        else:
            self.ticks = list(dict.fromkeys(fmt(v) for v in values))
            step = (RIGHT - LEFT) / max(len(self.ticks), 1)
            self._slots = {v: LEFT + step * (i + 0.5) for i, v in enumerate(self.ticks)}

    def __call__(self, value: Any) -> float:
        return self._to(float(value)) if self.numeric else self._slots[fmt(value)]


def _scale(low: float, high: float, start: float, end: float) -> Scale:
    return lambda v: start + (v - low) / (high - low) * (end - start)


def _axes(xs: _XAxis, x_label: str, y_ticks: Sequence[float], scale_y: Scale) -> list[str]:
    parts = [f'<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="#888"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#888"/>']
    for value, label in zip(y_ticks, tick_labels(y_ticks), strict=True):
        y = scale_y(value)
        parts.append(f'<line x1="{LEFT + 1}" y1="{y:.1f}" x2="{RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text class="y-tick" x="{LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">{escape(label)}</text>')
    for tick in xs.ticks:
        parts.append(f'<text x="{xs(tick):.1f}" y="{BOTTOM + 15}" text-anchor="middle">{escape(fmt(tick))}</text>')
    parts.append(f'<text class="x-label" x="{(LEFT + RIGHT) / 2}" y="{BOTTOM + 36}" text-anchor="middle" '
                 f'font-weight="bold">{escape(x_label)}</text>')
    return parts


def _series(run: str, points: Sequence[Point], metric: str, key: str | None, xs: _XAxis, scale_y: Scale,
            colour: str) -> str:
    """A run's points (hover: their values), joined by a line per other item value, labelled at its end."""
    parts = [f'<g class="series" data-run="{escape(run)}" fill="{colour}" stroke="{colour}">']
    for line in dict.fromkeys(p.line for p in points):
        joined = sorted((p for p in points if p.line == line), key=lambda p: xs(p.x))
        if len(joined) > 1:
            coords = " ".join(f"{xs(p.x):.1f},{scale_y(p.y):.1f}" for p in joined)
            parts.append(f'<polyline fill="none" stroke-width="1.5" points="{coords}"/>')
        if line:
            end = joined[-1]
            parts.append(f'<text x="{xs(end.x) + 7:.1f}" y="{scale_y(end.y) + 4:.1f}" stroke="none" '
                         f'font-size="9">{escape(" ".join(line))}</text>')
    for p in points:
        what = [run, p.row.item] if p.row.item else [run]
        what += [f"{key}={fmt(p.x)}"] if key is not None else []
        what += [*p.line, f"{metric}={fmt(p.y)}"]
        parts.append(f'<circle cx="{xs(p.x):.1f}" cy="{scale_y(p.y):.1f}" r="4" stroke="none">'
                     f"<title>{escape(' · '.join(what))}</title></circle>")
    parts.append("</g>")
    return "".join(parts)


def _legend(run_ids: Sequence[str], colour: dict[str, str], missing: dict[str, str]) -> list[str]:
    """Every run compared, in its colour; one not in this chart greyed, saying why (``no value``)."""
    parts = []
    for i, run in enumerate(run_ids):
        y = TOP + 8 + i * 18
        why = missing.get(run)
        fill = "#ccc" if why else colour[run]
        note = f' <tspan fill="#888">({escape(why)})</tspan>' if why else ""
        parts.append(f'<rect x="{LEGEND}" y="{y - 9}" width="10" height="10" fill="{fill}"/>'
                     f'<text class="legend" x="{LEGEND + 16}" y="{y}">{escape(run)}{note}</text>')
    return parts
