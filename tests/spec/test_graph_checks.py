"""check_graph on random specs: outs claimed twice and deps nobody writes, found through the path
index as every pair of paths found them, in the same order; and at 5,000 stages, without pairs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import SpecIssue
from conveyor.plan import dag
from conveyor.spec.checks import check_graph
from conveyor.spec.models import Stage
from conveyor.spec.yamlmap import Key, LoadedYaml


def stages_of(bodies: dict[str, dict[str, Any]]) -> dict[str, Stage]:
    return {name: Stage.model_validate({"task": "tasks.steps:fetch", **body}) for name, body in bodies.items()}


def pairwise_issues(doc: LoadedYaml, stages: dict[str, Stage], root: Path) -> list[SpecIssue]:
    """What check_graph reported before the index (cycles aside): every path against every other."""
    issues: list[SpecIssue] = []
    owners: list[tuple[str, Key, str]] = []
    for name, stage in stages.items():
        for kind, items in (("outs", stage.out_items), ("metrics", stage.metric_items)):
            owners += [(name, ("stages", name, kind, item.name or i), item.path) for i, item in enumerate(items)]
    for n, (_, key, path) in enumerate(owners):
        for other, _, other_path in owners[:n]:
            if dag.overlaps(path, other_path):
                issues.append(SpecIssue(doc.path, doc.line(key), ".".join(map(str, key[:3])),
                                        f"'{path}' is also written by stage '{other}' ('{other_path}'): "
                                        "every out has one producer"))
    produced = [p for *_, p in owners]
    for name, stage in stages.items():
        for i, item in enumerate(stage.dep_items):
            if not any(dag.overlaps(item.path, p) for p in produced) and not (root / item.path).exists():
                issues.append(SpecIssue(doc.path, doc.line(("stages", name, "deps", i)), f"stages.{name}.deps",
                                        f"'{item.path}' does not exist and no stage writes it"))
    return issues


def random_bodies(rng: random.Random, n: int) -> dict[str, dict[str, Any]]:
    def path() -> str:
        return "/".join(rng.choice(["data", "data2", "d", "m"]) for _ in range(rng.randint(1, 3))) + \
            rng.choice(["", "", "/"])

    return {f"s{k}": {"deps": [path() for _ in range(rng.randint(0, 2))],
                      "outs": [path() for _ in range(rng.randint(0, 2))],
                      "metrics": [path() + ".json" for _ in range(rng.randint(0, 1))]} for k in range(n)}


@pytest.mark.parametrize("seed", range(30))
def test_graph_checks_find_what_every_pair_found(seed: int, tmp_path: Path) -> None:
    stages = stages_of(random_bodies(random.Random(seed), 10))
    (tmp_path / "d").mkdir()  # a dep that exists on disk is not missing
    doc = LoadedYaml(tmp_path / "pipeline.yaml", {}, {("stages", name): k + 3 for k, name in enumerate(stages)})
    acyclic = {name: frozenset[str]() for name in stages}
    assert check_graph(doc, stages, acyclic, tmp_path, bad_paths=set()) == pairwise_issues(doc, stages, tmp_path)


def test_graph_checks_of_5000_stages_compare_no_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of 5,000 stages (s0 ──► s1 ──► ... ──► s4999) with one out claimed twice and one
    dep nobody writes: both found, and no path compared with every other."""
    calls = 0
    real = dag.overlaps

    def counted(a: str, b: str) -> bool:
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(dag, "overlaps", counted)
    n = 5000
    bodies: dict[str, dict[str, Any]] = {f"s{k}": {"deps": [f"out/s{k - 1}.txt"] if k else [],
                                                   "outs": [f"out/s{k}.txt"]} for k in range(n)}
    bodies["s4999"]["outs"] = ["out/s3.txt"]
    bodies["s7"]["deps"] = ["out/nobody.txt"]
    stages = stages_of(bodies)
    doc = LoadedYaml(tmp_path / "pipeline.yaml", {})
    issues = check_graph(doc, stages, dag.stage_graph(stages), tmp_path, bad_paths=set())
    assert [i.message for i in issues] == [
        "'out/s3.txt' is also written by stage 's3' ('out/s3.txt'): every out has one producer",
        "'out/nobody.txt' does not exist and no stage writes it"]
    assert calls < n
