"""The spec's ``model:`` section (SPEC.md §2.4): what ``conveyor predict`` and ``serve-model`` score
with. Each case writes a spec into a real project in ``tmp_path`` and pins what the user reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from conveyor.errors import SpecError
from conveyor.spec.project import load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

SPEC = """\
pipeline: demo
stages:
  train:
    task: tasks.steps:train
    outs: [models/, data/stats.json]
model:
{model}
"""
SCORER = "def load(files):\n    return files\n\n\ndef score(model, rows):\n    return rows.sum(axis=1)\n"


def problems(project: ProjectDir, model: str) -> list[str]:
    path = project.spec(SPEC.format(model=model))
    with pytest.raises(SpecError) as info:
        load_project(path)
    return [str(issue) for issue in info.value.issues]


@pytest.fixture
def scorer(project: ProjectDir) -> ProjectDir:
    project.good_spec()  # writes the task package
    project.write("tasks/scoring.py", SCORER)
    return project


def test_a_model_section_is_read(scorer: ProjectDir) -> None:
    path = scorer.spec(SPEC.format(model="""\
  files: {booster: models/xgb.json, stats: data/stats.json}
  features: data/stats.json:columns
  load: tasks.scoring:load
  predict: tasks.scoring:score
  id: customer_id
"""))
    model = load_project(path).pipeline.model
    assert model is not None
    assert model.files == {"booster": "models/xgb.json", "stats": "data/stats.json"}
    assert (model.features, model.id, model.registry) == ("data/stats.json:columns", "customer_id",
                                                          "models/registry.json")


def test_features_may_be_listed(scorer: ProjectDir) -> None:
    path = scorer.spec(SPEC.format(model="  files: {m: models/m.json}\n  features: [a, b]\n"
                                         "  predict: tasks.scoring:score\n"))
    model = load_project(path).pipeline.model
    assert model is not None and model.features == ("a", "b") and model.load is None


@pytest.mark.parametrize(("model", "expected"), [
    ("  files: {m: models/m.json}\n  features: [a]\n  predict: tasks.scoring:score\n  predcit: x\n",
     "model.predcit: unknown key 'predcit' (did you mean 'predict'?)"),
    ("  files: {m: model.pkl}\n  features: [a]\n  predict: tasks.scoring:score\n",
     "model.files.m: 'model.pkl' is not written by any stage (an out, or a file in one)"),
    ("  files: {m: models/m.json}\n  features: other.json:cols\n  predict: tasks.scoring:score\n",
     "features 'other.json:cols': give the columns as a list, or as FILE:KEY where FILE is one of the "
     "model's files (models/m.json)"),
    ("  files: {m: models/m.json}\n  features: [a, a]\n  predict: tasks.scoring:score\n",
     "features: the input columns, each once"),
    ("  files: {}\n  features: [a]\n  predict: tasks.scoring:score\n",
     "name the outs that make up the model"),
    ("  files: {m: models/m.json}\n  features: [a]\n  predict: score\n",
     "'score' is not a function: write it as module:function"),
    ("  files: {m: models/m.json}\n  features: [a]\n  predict: tasks.scoring:scor\n",
     "model.predict: unknown function 'tasks.scoring:scor': no function 'scor' in scoring.py "
     "(did you mean 'score'?)"),
    ("  files: {m: models/m.json}\n  features: [a]\n",
     "model.predict: is required"),
])
def test_a_bad_model_section_is_named(scorer: ProjectDir, model: str, expected: str) -> None:
    found = problems(scorer, model)
    assert any(expected in p for p in found), found
    assert all(":" in p.split(" ", 1)[0] for p in found)  # each names the file and line
