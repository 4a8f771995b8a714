"""What a run record keeps of a dvc.yaml's stages (issue 32 item 7), read when the project loads:
the params each stage declares, with their values as the files hold them (a hand edit shows at
once), and the foreach or matrix item each stage was made from, in every form DVC has.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from repos import git_dvc_init

from conveyor.spec.project import load_project

DVC_YAML = """\
stages:
  train:
    cmd: echo ${lr} > model.txt
    params: [lr, opt]
    outs: [model.txt]
  names:
    foreach: [a, b]
    do:
      cmd: echo ${item}
      params:
        - sub/other.yaml:
  records:
    foreach: [{n: 1}, {n: 2}]
    do:
      cmd: echo ${item.n}
  keyed:
    foreach: {small: {size: 1}, big: {size: 9}}
    do:
      cmd: echo ${key} ${item.size}
  grid:
    matrix: {x: [1, 2], y: [a]}
    cmd: echo ${item.x} ${item.y}
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git_dvc_init(tmp_path)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "params.yaml").write_text("lr: 0.1\nopt: {name: adam, beta: 0.9}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/other.yaml").write_text("depth: 3\n")
    return tmp_path


def test_each_stage_s_declared_params_as_the_files_hold_them(repo: Path) -> None:
    project = load_project(repo / "dvc.yaml")
    assert project.stage_params("train") == {"lr": 0.1, "opt": {"name": "adam", "beta": 0.9}}
    assert project.stage_params("names@a") == {"sub/other.yaml:depth": 3}  # a whole file, after its path
    assert project.stage_params("grid@1-a") == {}
    (repo / "params.yaml").write_text("lr: 0.5\nopt: {name: sgd}\n")  # edited by hand: read as it is now
    assert project.stage_params("train") == {"lr": 0.5, "opt": {"name": "sgd"}}


def test_each_foreach_and_matrix_item_as_its_command_reads_it(repo: Path) -> None:
    project = load_project(repo / "dvc.yaml")
    assert {name: project.item_of(name) for name in project.order} == {
        "train": None,
        "names@a": {"item": "a"}, "names@b": {"item": "b"},
        "records@0": {"n": 1}, "records@1": {"n": 2},
        "keyed@small": {"key": "small", "size": 1}, "keyed@big": {"key": "big", "size": 9},
        "grid@1-a": {"x": 1, "y": "a"}, "grid@2-a": {"x": 2, "y": "a"},
    }
