"""The DAG laid out in layers, for the picture of ``conveyor dag --format html``.

Sugiyama's method, reduced to what a pipeline of a few hundred stages needs. A stage's layer
(its column, left to right) is the longest path to it from a stage with no upstream, so every
edge points right. An edge that spans several layers gets a bend point in each layer it
crosses, kept in the layer's order like a stage, so that it is routed between stages rather
than through them. Within a layer, stages are ordered by the barycentre of their neighbours
in the layer before, then (sweeping back) in the layer after, a few times over; the order
with the fewest crossings wins. Pure: positions in layers and rows, no pixels, no I/O.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from conveyor.plan.dag import Graph, topological_order

Bend = tuple[str, str, int]  # an edge's bend point: (upstream stage, downstream stage, layer)
Node = str | Bend
SWEEPS = 8  # down-and-up sweeps of barycentric ordering; more rarely removes another crossing


@dataclass(frozen=True, slots=True)
class Layout:
    """Each layer's nodes top to bottom (stages and bend points), and each edge's path."""

    layers: tuple[tuple[Node, ...], ...]
    edges: tuple[tuple[str, str], ...]  # (upstream, downstream), in dependency order

    def at(self) -> dict[Node, tuple[int, int]]:
        """Every node's (layer, row)."""
        return {node: (i, row) for i, layer in enumerate(self.layers) for row, node in enumerate(layer)}

    def path(self, up: str, down: str) -> list[Node]:
        """The edge from ``up`` to ``down`` through its bend points."""
        where = self.at()
        return [up, *((up, down, i) for i in range(where[up][0] + 1, where[down][0])), down]


def layered(graph: Graph, order: Sequence[str] | None = None, sweeps: int = SWEEPS) -> Layout:
    """Lay ``graph`` (stage -> its upstream stages) out in layers; ``order`` (the spec's) breaks ties."""
    order = list(order) if order is not None else topological_order(graph)
    layer_of = longest_path_layers(graph, order)
    rank = {stage: i for i, stage in enumerate(order)}
    edges = tuple((up, down) for down in order for up in sorted(graph[down], key=rank.__getitem__))
    layers: list[list[Node]] = [[] for _ in range(max(layer_of.values(), default=-1) + 1)]
    for stage in order:
        layers[layer_of[stage]].append(stage)
    ups: dict[Node, list[Node]] = {node: [] for layer in layers for node in layer}
    for up, down in edges:
        chain: list[Node] = [up, *((up, down, i) for i in range(layer_of[up] + 1, layer_of[down])), down]
        for before, after in pairwise(chain):
            if isinstance(after, tuple):
                layers[after[2]].append(after)
            ups.setdefault(after, []).append(before)
    return Layout(tuple(tuple(layer) for layer in _ordered(layers, ups, sweeps)), edges)


def longest_path_layers(graph: Graph, order: Sequence[str]) -> dict[str, int]:
    """Each stage's layer: 0 with no upstream, else one more than its furthest upstream."""
    layer: dict[str, int] = {}
    for stage in topological_order(graph, order):
        layer[stage] = 1 + max((layer[up] for up in graph[stage]), default=-1)
    return layer


def _ordered(layers: list[list[Node]], ups: Mapping[Node, list[Node]], sweeps: int) -> list[list[Node]]:
    """The layers reordered by barycentric sweeps; the order with the fewest crossings."""
    downs: dict[Node, list[Node]] = {node: [] for node in ups}
    for node, before in ups.items():
        for up in before:
            downs[up].append(node)
    best, fewest = [list(layer) for layer in layers], count_crossings(layers, ups)
    for _ in range(sweeps):
        if fewest == 0:
            break
        for i in range(1, len(layers)):
            layers[i] = _by_barycentre(layers[i], layers[i - 1], ups)
        for i in range(len(layers) - 2, -1, -1):
            layers[i] = _by_barycentre(layers[i], layers[i + 1], downs)
        found = count_crossings(layers, ups)
        if found < fewest:
            best, fewest = [list(layer) for layer in layers], found
    return best


def _by_barycentre(layer: list[Node], fixed: list[Node], neighbours: Mapping[Node, list[Node]]) -> list[Node]:
    """``layer`` sorted by the mean row of each node's neighbours in ``fixed``; a node with none keeps its row."""
    row = {node: i for i, node in enumerate(fixed)}

    def key(item: tuple[int, Node]) -> tuple[float, int]:
        at, node = item
        rows = [row[n] for n in neighbours[node] if n in row]
        return (sum(rows) / len(rows) if rows else float(at), at)

    return [node for _, node in sorted(enumerate(layer), key=key)]


def count_crossings(layers: Sequence[Sequence[Node]], ups: Mapping[Node, Sequence[Node]]) -> int:
    """How many pairs of edge segments cross between adjacent layers (bend points make every
    segment span one layer): per pair of layers, the inversions among the segments' ends."""
    total = 0
    for i in range(1, len(layers)):
        before = {node: r for r, node in enumerate(layers[i - 1])}
        segments = sorted((before[up], r) for r, node in enumerate(layers[i]) for up in ups[node] if up in before)
        seen: list[int] = []
        for _, end in segments:
            total += len(seen) - bisect_right(seen, end)
            insort(seen, end)
    return total
