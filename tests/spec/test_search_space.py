"""What `conveyor search` asks for, checked against the project before any trial: every
problem in one line, the way to write it said (no project is run here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.errors import UsageError
from conveyor.spec.project import Project, load_project
from conveyor.spec.search import Dimension, Objective, Search, check_search, grid_of, parse_dimension, parse_objective

SPEC = """\
pipeline: s
stages:
  train:
    cmd: python fit.py ${train.alpha}
    params: [train]
    outs: [model.txt]
    metrics: [metrics/fit.json]
  other:
    cmd: python other.py
    params: [seed]
    outs: [other.txt]
  grid:
    matrix: {k: [1, 2]}
    cmd: python g.py ${item.k}
    outs: ['g-${item.k}.txt']
"""


@pytest.fixture
def project(tmp_path: Path) -> Project:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text(SPEC)
    (tmp_path / "params.yaml").write_text("seed: 1\ntrain:\n  alpha: 1.0\n  depth: 3\n  model: ridge\n")
    return load_project(tmp_path / "configs/pipeline.yaml")


def test_the_kinds_of_a_param_parse_with_numbers_as_a_user_writes_them() -> None:
    assert parse_dimension("train.alpha=loguniform(1e-4, 10)") == Dimension("train.alpha", "loguniform", 1e-4, 10)
    assert parse_dimension("train.depth=int(2,8)") == Dimension("train.depth", "int", 2, 8)
    assert parse_dimension("train.model=choice(ridge, lasso, 3)").choices == ("ridge", "lasso", 3)
    assert grid_of([parse_dimension("a=int(1,3)"), parse_dimension("b=choice(x,y)")]) == {
        "a": [1, 2, 3], "b": ["x", "y"]}


@pytest.mark.parametrize(("text", "said"), [
    ("train.alpha", "write it as KEY=KIND(ARGS)"),
    ("train.alpha=normal(0,1)", "unknown kind 'normal'"),
    ("train.alpha=loguniform(0,1)", "LOW must be above 0"),
    ("train.alpha=uniform(2,1)", "LOW must be below HIGH"),
    ("train.depth=int(1.5,3)", "int(LOW,HIGH) takes two integers"),
])
def test_a_param_written_wrong_says_how_to_write_it(text: str, said: str) -> None:
    with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
        parse_dimension(text)


def test_every_problem_against_the_project_is_said_at_once(project: Project) -> None:
    wanted = Search("train", (parse_dimension("train.alfa=uniform(0,1)"), parse_dimension("seed=int(1,3)"),
                              parse_dimension("train.depth=uniform(1,5)")),
                    parse_objective("metrics/train.json:rmse", minimize=True))
    with pytest.raises(UsageError) as raised:
        check_search(project, wanted)
    assert str(raised.value) == (
        "--param train.alfa: params.yaml has no key 'train.alfa' (did you mean 'train.alpha'?) (a search sets "
        "params the file has); --param seed: train does not read it (its params: train), so no trial would "
        "differ; --param train.depth: it is 3 in params.yaml: search it with int(LOW,HIGH) or choice(...); "
        "--objective metrics/train.json:rmse: metrics/train.json is not a metrics file of train "
        "(its metrics: metrics/fit.json)")


def test_a_matrix_or_an_unknown_stage_is_refused_with_the_stages_named(project: Project) -> None:
    space = (Dimension("train.alpha", "uniform", 0, 1),)
    with pytest.raises(UsageError, match=r"'grid' is a matrix \(2 items\)"):
        check_search(project, Search("grid", space, Objective("metrics/fit.json", "x", True)))
    with pytest.raises(UsageError, match=r"unknown stage 'trian' \(did you mean 'train'\?\)"):
        check_search(project, Search("trian", space, Objective("metrics/fit.json", "x", True)))


def test_the_grid_sampler_takes_only_params_it_can_list(project: Project) -> None:
    wanted = Search("train", (Dimension("train.alpha", "uniform", 0, 1),), Objective("metrics/fit.json", "x", True),
                    sampler="grid")
    with pytest.raises(UsageError, match=r"the grid sampler needs values it can list"):
        check_search(project, wanted)


def test_the_study_is_the_same_for_the_same_search_whatever_its_trials_or_timeout() -> None:
    space = (Dimension("train.alpha", "uniform", 0, 1),)
    first = Search("train", space, Objective("m.json", "x", True), trials=4)
    assert first.study == Search("train", space, Objective("m.json", "x", True), trials=20, timeout_s=5).study
    assert first.study != Search("train", space, Objective("m.json", "x", False)).study
    assert first.study.startswith("train-")
