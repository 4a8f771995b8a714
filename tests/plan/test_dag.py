"""The planner on tiny hand-drawn DAGs: edges, cycles, order, selection, the critical path.

Arrows point the way data flows: ``a ──► b`` means b waits for a. Pipelines are built
with ``Pipeline.model_validate``; no files, no clusters.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from conveyor.plan import dag
from conveyor.spec.models import Pipeline


def pipeline(**stages: dict[str, Any]) -> Pipeline:
    """A pipeline whose stages all run the same task; only the graph matters here."""
    return Pipeline.model_validate({
        "pipeline": "test",
        "stages": {name: {"task": "tasks.steps:fetch", **body} for name, body in stages.items()},
    })


def graph_of(**stages: dict[str, Any]) -> dict[str, frozenset[str]]:
    return dag.upstream_graph(pipeline(**stages))


def g(**ups: str) -> dict[str, frozenset[str]]:
    """A graph from ``stage="up1 up2"`` strings."""
    return {name: frozenset(u.split()) for name, u in ups.items()}


# --- edges ------------------------------------------------------------------------------


def test_edges_from_needs() -> None:
    """
    a ──► b        (b needs a; no data between them)
    c
    """
    assert graph_of(a={}, b={"needs": ["a"]}, c={}) == g(a="", b="a", c="")


def test_edges_from_an_out_that_is_a_dep() -> None:
    """
    ingest ──► prepare ──► train        data/raw, then data/processed
    """
    graph = graph_of(
        ingest={"outs": ["data/raw"]},
        prepare={"deps": ["data/raw"], "outs": ["data/processed"]},
        train={"deps": ["data/processed"], "outs": ["models/m.json"]},
    )
    assert graph == g(ingest="", prepare="ingest", train="prepare")


def test_edge_to_a_dep_inside_an_out_directory() -> None:
    """
    ingest ──► prepare        ingest writes data/raw/, prepare reads data/raw/part-0.csv
    """
    graph = graph_of(ingest={"outs": ["data/raw"]}, prepare={"deps": ["data/raw/part-0.csv"]})
    assert graph == g(ingest="", prepare="ingest")


def test_edge_from_an_out_inside_a_dep_directory() -> None:
    """
    xgb ──► report ◄── mlp        both write into models/; report reads models/
    """
    graph = graph_of(
        xgb={"outs": ["models/xgb.json"]},
        mlp={"outs": ["models/mlp.pt"]},
        report={"deps": ["models/"]},
    )
    assert graph == g(xgb="", mlp="", report="xgb mlp")


def test_edge_from_metrics_and_needs_together() -> None:
    """
    train ──► report        report reads train's metrics file
    prep  ──┘               and needs prep explicitly
    """
    graph = graph_of(prep={}, train={"metrics": ["metrics/train.json"]},
                     report={"deps": ["metrics/train.json"], "needs": ["prep"]})
    assert graph == g(prep="", train="", report="train prep")


def test_no_edge_between_paths_that_only_share_a_prefix() -> None:
    """
    a    b        a writes data/raw, b reads data/raw2: no edge
    """
    assert graph_of(a={"outs": ["data/raw"]}, b={"deps": ["data/raw2", "data/ra"]}) == g(a="", b="")


@pytest.mark.parametrize(("a", "b", "expected"), [
    ("data", "data", True),
    ("data", "data/x", True),
    ("data/x/y", "data", True),
    ("data/", "data/x", True),
    ("data", "data2", False),
    ("data/x", "data/y", False),
])
def test_overlaps(a: str, b: str, expected: bool) -> None:
    assert dag.overlaps(a, b) is expected
    assert dag.overlaps(b, a) is expected


def test_downstream_graph_inverts_the_edges() -> None:
    """
    a ──► b ──► d
    └───► c
    """
    assert dag.downstream_graph(g(a="", b="a", c="a", d="b")) == g(a="b c", b="d", c="", d="")


# --- cycles -----------------------------------------------------------------------------


def test_find_cycle_on_a_dag_is_none() -> None:
    """
    a ──► b ──► d
    └───► c ──┘
    """
    assert dag.find_cycle(g(a="", b="a", c="a", d="b c")) is None


def test_find_cycle_of_two() -> None:
    """
    a ◄──► b
    """
    cycle = dag.find_cycle(g(a="b", b="a"))
    assert cycle in (["a", "b", "a"], ["b", "a", "b"])


def test_find_cycle_of_three_names_each_stage_once() -> None:
    """
    x ──► a ──► b ──► c
          ▲───────────┘
    """
    cycle = dag.find_cycle(g(x="", a="x c", b="a", c="b"))
    assert cycle is not None
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["a", "b", "c"]


def test_find_cycle_follows_the_data_flow() -> None:
    """
    a ──► b ──► c        every arrow of the printed cycle is an edge of the pipeline
    ▲───────────┘
    """
    graph = g(a="c", b="a", c="b")
    cycle = dag.find_cycle(graph)
    assert cycle is not None
    assert all(up in graph[down] for up, down in itertools.pairwise(cycle)), cycle


def test_a_stage_that_needs_itself_is_a_cycle() -> None:
    """
    a ─┐
    ▲──┘
    """
    assert dag.find_cycle(g(a="a")) == ["a", "a"]


# --- order ------------------------------------------------------------------------------


def test_topological_order_breaks_ties_by_spec_order() -> None:
    """
    c    a    b        no edges: the spec order decides
    """
    assert dag.topological_order(g(a="", b="", c=""), ["c", "a", "b"]) == ["c", "a", "b"]


def test_topological_order_of_a_diamond() -> None:
    """
    a ──► b ──► d
    └───► c ──┘        spec order a, c, b, d: c before b
    """
    graph = g(a="", b="a", c="a", d="b c")
    assert dag.topological_order(graph, ["a", "c", "b", "d"]) == ["a", "c", "b", "d"]
    assert dag.topological_order(graph, ["d", "b", "c", "a"]) == ["a", "b", "c", "d"]


def test_topological_order_without_spec_order_uses_the_graph_order() -> None:
    """
    z ──► y        x
    """
    assert dag.topological_order(g(z="", x="", y="z")) == ["z", "x", "y"]


def test_topological_order_ranks_each_wave_not_the_whole_spec() -> None:
    """
    a ──► b        c
    A stage whose upstream finished later never jumps ahead of a ready one.
    """
    assert dag.topological_order(g(b="a", a="", c=""), ["b", "a", "c"]) == ["a", "c", "b"]


# --- selection --------------------------------------------------------------------------

CHAIN = g(ingest="", prepare="ingest", xgb="prepare", mlp="prepare", stack="xgb mlp", other="")
"""
ingest ──► prepare ──► xgb ──► stack
                  └──► mlp ──┘
other
"""


def test_select_nothing_means_everything() -> None:
    assert dag.select(CHAIN, []) == set(CHAIN)


def test_select_takes_the_targets_and_their_upstream() -> None:
    assert dag.select(CHAIN, ["xgb"]) == {"ingest", "prepare", "xgb"}
    assert dag.select(CHAIN, ["stack"]) == {"ingest", "prepare", "xgb", "mlp", "stack"}
    assert dag.select(CHAIN, ["other"]) == {"other"}


def test_select_downstream_takes_the_targets_and_what_follows() -> None:
    assert dag.select(CHAIN, ["xgb"], downstream=True) == {"xgb", "stack"}
    assert dag.select(CHAIN, ["prepare"], downstream=True) == {"prepare", "xgb", "mlp", "stack"}
    assert dag.select(CHAIN, ["xgb", "other"], downstream=True) == {"xgb", "stack", "other"}


# --- critical path ----------------------------------------------------------------------


def test_critical_path_is_the_longest_chain_of_durations() -> None:
    """
    a(1) ──► b(5) ──► d(1)
    └──────► c(2) ──┘
    """
    graph = g(a="", b="a", c="a", d="b c")
    assert dag.critical_path(graph, {"a": 1.0, "b": 5.0, "c": 2.0, "d": 1.0}) == (["a", "b", "d"], 7.0)
    assert dag.critical_path(graph, {"a": 1.0, "b": 1.0, "c": 2.0, "d": 1.0}) == (["a", "c", "d"], 4.0)


def test_critical_path_of_independent_stages_is_the_longest_one() -> None:
    """
    a(1)    b(3)    c(2)        stages without a duration (skipped) count as 0
    """
    assert dag.critical_path(g(a="", b="", c="", e=""), {"a": 1.0, "b": 3.0, "c": 2.0}) == (["b"], 3.0)


def test_critical_path_of_nothing() -> None:
    assert dag.critical_path({}, {}) == ([], 0.0)


# --- the path index: the graph at any scale, the same graph ------------------------------


def pairwise_graph(stages: dict[str, Any]) -> dict[str, frozenset[str]]:
    """The graph as conveyor built it before the index: every dep against every out, by :func:`dag.overlaps`."""
    built = pipeline(**stages).stages
    return {name: frozenset({other for other, o in built.items() if other != name
                             and any(dag.overlaps(w, d) for w in o.written for d in stage.deps)}
                            | (set(stage.needs) & set(built)))
            for name, stage in built.items()}


def random_stages(rng: random.Random, n: int) -> dict[str, dict[str, Any]]:
    """``n`` stages reading and writing paths drawn from a small tree (so that many overlap:
    equal, nested either way, sharing only a prefix), some with a trailing ``/``."""
    def path() -> str:
        parts = [rng.choice(["data", "data2", "d", "m"]) for _ in range(rng.randint(1, 4))]
        return "/".join(parts) + rng.choice(["", "", "/"])

    names = [f"s{k}" for k in range(n)]
    return {name: {"deps": [path() for _ in range(rng.randint(0, 3))],
                   "outs": [path() for _ in range(rng.randint(0, 2))],
                   "metrics": [path() + ".json" for _ in range(rng.randint(0, 1))],
                   "needs": rng.sample(names, rng.randint(0, 2))}
            for name in names}


@pytest.mark.parametrize("seed", range(30))
def test_the_index_builds_the_pairwise_graph(seed: int) -> None:
    """On random specs whose paths overlap in every way, the graph is the one every pair gave."""
    stages = random_stages(random.Random(seed), 12)
    assert graph_of(**stages) == pairwise_graph(stages)


@pytest.mark.parametrize("seed", range(10))
def test_the_index_finds_what_overlaps_finds(seed: int) -> None:
    rng = random.Random(seed)
    paths = [p for body in random_stages(rng, 30).values() for p in body["deps"] + body["outs"]]
    index = dag.PathIndex()
    for k, p in enumerate(paths):
        assert index.add(p, f"o{k}") == k
    for query in paths:
        assert index.keys(query) == {k for k, p in enumerate(paths) if dag.overlaps(p, query)}


@pytest.mark.parametrize("shape", ["chain", "wide"])
def test_a_graph_of_5000_stages_asks_overlaps_of_no_pair(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    chain:  s0 ──► s1 ──► ... ──► s4999          wide:  s0 ──► s1 ... s4998 ──► s4999
                                                              └─► (each)  ──────┘
    Before the index, every dep was compared with every out: 25 million calls for 5,000 stages.
    """
    calls = 0
    real = dag.overlaps

    def counted(a: str, b: str) -> bool:
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(dag, "overlaps", counted)
    n = 5000
    if shape == "chain":
        stages = {f"s{k}": {"deps": [f"out/s{k - 1}.txt"] if k else [], "outs": [f"out/s{k}.txt"]} for k in range(n)}
        expected = {f"s{k}": frozenset({f"s{k - 1}"} if k else ()) for k in range(n)}
    else:
        mid = {f"s{k}": {"deps": ["out/s0"], "outs": [f"out/mid/s{k}"]} for k in range(1, n - 1)}
        stages = {"s0": {"outs": ["out/s0"]}, **mid, f"s{n - 1}": {"deps": ["out/mid"], "outs": ["out/last"]}}
        expected = {"s0": frozenset(), **{name: frozenset({"s0"}) for name in mid},
                    f"s{n - 1}": frozenset(mid)}
    assert graph_of(**stages) == expected
    assert calls < n
