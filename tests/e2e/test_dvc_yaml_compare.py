"""``conveyor compare`` over runs of an existing dvc.yaml whose params the user edits by hand
(issue 32 item 7): the run record keeps the params each stage declares and each foreach or
matrix item's values, so the change between two runs shows.

    train (params: train.lr, train.epochs; cfg.json:seed) ──► eval@{1,2} (matrix: fold)

Between the runs, params.yaml is edited by hand and ``dvc repro`` (another actor) runs the
pipeline before conveyor does: conveyor then skips every stage, and its record still holds
the params as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from projects import Project

pytestmark = pytest.mark.slow

DVC_YAML = """
stages:
  train:
    cmd: python -c "open('model.txt', 'w').write('${train.lr}')"
    params:
      - train.lr
      - train.epochs
      - cfg.json:
          - seed
    outs:
      - model.txt
  eval:
    matrix:
      fold: [1, 2]
    cmd: python -c "import json; json.dump({'acc':${item.fold}/10 + ${train.lr}}, open('acc-${item.fold}.json', 'w'))"
    deps:
      - model.txt
    metrics:
      - acc-${item.fold}.json:
          cache: false
"""


@pytest.fixture
def dvc_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.init_dvc()
    project.write(".gitignore", "/.conveyor/\n")
    project.write("dvc.yaml", DVC_YAML)
    project.write("params.yaml", "train:\n  lr: 0.1\n  epochs: 3\n")
    project.write("cfg.json", '{"seed": 7}\n')
    return project


def test_compare_shows_a_hand_edited_param_of_a_dvc_yaml(dvc_project: Project) -> None:
    first = dvc_project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    record = dvc_project.record()
    assert record["params"] == {"train.lr": 0.1, "train.epochs": 3, "cfg.json:seed": 7}
    assert {name: stage["item"] for name, stage in record["stages"].items()} == {
        "train": None, "eval@1": {"fold": 1}, "eval@2": {"fold": 2}}

    dvc_project.write("params.yaml", "train:\n  lr: 0.5\n  epochs: 3\n")  # the user's hand edit
    dvc_project.sh("dvc", "repro", "-q")  # someone else runs the pipeline first
    second = dvc_project.conveyor("run")
    assert second.returncode == 0, second.stdout + second.stderr
    record = dvc_project.record()
    assert {stage["status"] for stage in record["stages"].values()} == {"skipped"}
    assert record["params"]["train.lr"] == 0.5

    shown = dvc_project.conveyor("compare")  # the param that changed, the items' values, the metric
    assert shown.returncode == 0, shown.stdout + shown.stderr
    heading = " ".join(line for line in shown.stdout.splitlines()[1:3])
    assert heading.split() == ["train.", "item.", "eval:", "run", "lr", "fold", "acc"], shown.stdout
    items = [line.split()[1:] for line in shown.stdout.splitlines() if line.startswith(("├", "└"))]
    assert items == [["eval@1", "0.1", "1", "0.2"], ["eval@2", "0.1", "2", "0.3"],
                     ["eval@1", "0.5", "1", "0.6"], ["eval@2", "0.5", "2", "0.7"]], shown.stdout
    assert "2 params the same in every row not shown (--all shows them)" in " ".join(shown.stdout.split())

    every = dvc_project.conveyor("compare", "--all")
    heading = " ".join(line for line in every.stdout.splitlines()[1:3])
    assert heading.split() == ["cfg.", "train.", "train.", "item.", "eval:",
                               "run", "json:seed", "epochs", "lr", "fold", "acc"], every.stdout
    items = [line.split()[1:] for line in every.stdout.splitlines() if line.startswith(("├", "└"))]
    assert items == [["eval@1", "7", "3", "0.1", "1", "0.2"], ["eval@2", "7", "3", "0.1", "2", "0.3"],
                     ["eval@1", "7", "3", "0.5", "1", "0.6"], ["eval@2", "7", "3", "0.5", "2", "0.7"]], every.stdout
