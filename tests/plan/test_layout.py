"""The layered layout of ``conveyor dag --format html`` on tiny hand-drawn DAGs, and one of 200 stages.

Arrows point the way data flows: ``a ──► b`` means b waits for a.
"""

from __future__ import annotations

import random
import time

from conveyor.plan.layout import count_crossings, layered, longest_path_layers


def g(**ups: str) -> dict[str, frozenset[str]]:
    """A graph from ``stage="up1 up2"`` strings."""
    return {name: frozenset(u.split()) for name, u in ups.items()}


def test_a_stage_sits_one_layer_right_of_its_furthest_upstream() -> None:
    """
    a ──► b ──► c
    └───────────► d        d waits for a and c: layer 3, not 1
                  ▲
                  c
    """
    graph = g(a="", b="a", c="b", d="a c")
    assert longest_path_layers(graph, list(graph)) == {"a": 0, "b": 1, "c": 2, "d": 3}
    layout = layered(graph)
    assert [[n for n in layer if isinstance(n, str)] for layer in layout.layers] == [["a"], ["b"], ["c"], ["d"]]
    assert layout.path("a", "d") == ["a", ("a", "d", 1), ("a", "d", 2), "d"]  # bends in the layers it crosses
    assert layout.path("c", "d") == ["c", "d"]


def test_barycentric_ordering_uncrosses_what_the_spec_order_crosses() -> None:
    """
    a ──► y        in the spec's order (a, b; x, y) both edges cross;
    b ──► x        ordered by barycentre, x moves beside b and none does
    """
    graph = g(a="", b="", x="b", y="a")
    naive = [["a", "b"], ["x", "y"]]
    assert count_crossings(naive, {"x": ["b"], "y": ["a"], "a": [], "b": []}) == 1
    layout = layered(graph)
    ups = {n: [u for u, d in layout.edges if d == n] for layer in layout.layers for n in layer}
    assert count_crossings(layout.layers, ups) == 0
    assert layout.layers[1] == ("y", "x")


def test_independent_stages_and_an_empty_graph() -> None:
    assert layered(g(a="", b="", c="")).layers == (("a", "b", "c"),)
    assert layered({}).layers == ()


def test_two_hundred_stages_are_laid_out_fast_with_few_crossings() -> None:
    """A sweep's shape, 200 stages: ingest fans out to 4 prepares, each to 48 trainings with
    links across, all of which an evaluation reads, plus a few long edges."""
    rng = random.Random(7)
    ups: dict[str, str] = {"ingest": ""}
    ups.update({f"prep{i}": "ingest" for i in range(4)})
    ups.update({f"train{i}": f"prep{i % 4}" + (f" train{i - 4}" if i >= 4 and rng.random() < 0.3 else "")
                for i in range(194)})
    ups["evaluate"] = " ".join(f"train{i}" for i in range(194)) + " ingest"
    graph = g(**ups)
    assert len(graph) == 200
    t0 = time.perf_counter()
    layout = layered(graph)
    elapsed = time.perf_counter() - t0
    placed = [n for layer in layout.layers for n in layer if isinstance(n, str)]
    assert sorted(placed) == sorted(graph)
    where = layout.at()
    assert all(where[up][0] < where[down][0] for up, down in layout.edges)  # every edge points right
    assert elapsed < 5, f"laid out in {elapsed:.2f}s"
