"""``matrix:`` in conveyor's spec: items named as DVC names them, ``${item.*}``, ``needs`` of a
group, errors at the matrix stage's line, and the DVC ``matrix:`` that ``conveyor compile`` writes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import yaml

from conveyor.dvc.compile import compile_stages
from conveyor.errors import SpecError
from conveyor.spec.project import Project, load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

SPEC = """
pipeline: sweep
profiles:
  cpu: {kind: dask, n_workers: 2}
stages:
  prepare:
    task: tasks.steps:prepare
    outs: [data/processed]
  train:
    task: tasks.steps:train
    on: cpu
    matrix:
      eta: ${sweep.etas}
      depth: [2, 4]
    params: [train.xgb]
    deps: [data/processed]
    outs:
      - models/xgb-${item.eta}-${item.depth}.json
    metrics:
      - metrics/xgb-${key}.json
  shell:
    cmd: python fit.py --model ${item.model} --rounds ${sweep.rounds} --out runs/${key}
    matrix:
      model: [mlp, xgb]
      flags: [[a, b], {x: 1}]
    outs:
      - runs/${key}
  stack:
    task: tasks.steps:stack
    needs: [train, prepare]
    outs: [models/stack.json]
"""

PARAMS_EXTRA = "sweep:\n  etas: [0.1, 0.3]\n  rounds: 50\n"


def _project(project: ProjectDir, spec: str = SPEC) -> Project:
    project.write("params.yaml", (project.root / "params.yaml").read_text() + PARAMS_EXTRA)
    return load_project(project.spec(spec))


def test_items_are_named_and_filled_in_as_dvc_does(project: ProjectDir) -> None:
    loaded = _project(project)
    stages = loaded.pipeline.stages
    assert [s for s in loaded.order if s.startswith("train")] == [
        "train@0.1-2", "train@0.1-4", "train@0.3-2", "train@0.3-4"]
    assert stages["train@0.3-4"].outs == ("models/xgb-0.3-4.json",)
    assert stages["train@0.3-4"].metrics == ("metrics/xgb-0.3-4.json",)
    assert stages["train@0.3-4"].on == "cpu" and stages["train@0.3-4"].params == ("train.xgb",)
    assert loaded.item_of("train@0.3-4") == {"eta": 0.3, "depth": 4}
    assert loaded.item_of("prepare") is None
    # a list or mapping value names its item by key and index, as DVC does
    assert [s for s in loaded.order if s.startswith("shell")] == [
        "shell@mlp-flags0", "shell@mlp-flags1", "shell@xgb-flags0", "shell@xgb-flags1"]
    assert stages["shell@xgb-flags1"].cmd == "python fit.py --model xgb --rounds 50 --out runs/xgb-flags1"
    assert loaded.item_of("shell@xgb-flags1") == {"model": "xgb", "flags": {"x": 1}}


def test_needs_of_a_group_means_every_item(project: ProjectDir) -> None:
    loaded = _project(project)
    assert loaded.graph["stack"] == {"prepare", "train@0.1-2", "train@0.1-4", "train@0.3-2", "train@0.3-4"}
    assert loaded.graph["train@0.1-2"] == {"prepare"}  # its dep is prepare's out
    assert loaded.expand(["train"]) == ["train@0.1-2", "train@0.1-4", "train@0.3-2", "train@0.3-4"]


def test_a_misspelt_need_of_a_group_names_the_group(project: ProjectDir) -> None:
    """Every other unknown name has a did-you-mean; a need is matched against the matrix's name too,
    not only against its items (``train@0.1-2`` is no close match for ``trian``)."""
    spec = SPEC.replace("needs: [train, prepare]", "needs: [trian, prepare]")
    with pytest.raises(SpecError) as caught:
        _project(project, spec)
    (issue,) = caught.value.issues
    assert (issue.key, issue.message) == ("stages.stack.needs.0", "unknown stage 'trian' (did you mean 'train'?)")


@pytest.mark.parametrize(("matrix", "key", "message"), [
    ("{}", "stages.train.matrix", "a matrix is a mapping of names to lists of values"),
    ("{eta: 0.1}", "stages.train.matrix.eta", "'eta' must list its values"),
    ("{eta: []}", "stages.train.matrix.eta", "'eta' must list its values"),
    ("{eta: '${sweep.nope}'}", "stages.train.matrix.eta", "unknown param key '${sweep.nope}'"),
    ("{eta: [1, '1']}", "stages.train.matrix", "two combinations are both named '1'"),
    ("{eta: ['a b']}", "stages.train.matrix", "the item 'a b': values name the stages of a matrix"),
])
def test_a_bad_matrix_is_reported_at_its_line(project: ProjectDir, matrix: str, key: str, message: str) -> None:
    spec = f"""
        pipeline: sweep
        stages:
          train:
            task: tasks.steps:train
            matrix: {matrix}
            outs: [models/m.json]
        """
    with pytest.raises(SpecError) as caught:
        _project(project, spec)
    (issue,) = caught.value.issues
    assert (issue.line, issue.key) == (5, key) and message in issue.message, issue


def test_an_unknown_item_key_is_named_once_with_its_line(project: ProjectDir) -> None:
    spec = """
        pipeline: sweep
        stages:
          train:
            task: tasks.steps:train
            matrix: {eta: [0.1, 0.3]}
            outs:
              - models/m-${item.rate}.json
            metrx: [m.json]
        """
    with pytest.raises(SpecError) as caught:
        _project(project, spec)
    found = {(i.line, i.message) for i in caught.value.issues}
    assert (7, "unknown param key '${item.rate}' (did you mean 'item.eta'?)") in found
    assert any(line == 8 and "unknown key 'metrx' (did you mean 'metrics'?)" in m for line, m in found)
    assert sum("item.rate" in m for _, m in found) == 1  # once, not once per item


def test_an_item_named_like_another_stage_is_an_error(project: ProjectDir) -> None:
    spec = """
        pipeline: sweep
        stages:
          train:
            task: tasks.steps:train
            matrix: {eta: [1]}
            outs: [models/a.json]
        """
    project.spec(spec)
    text = (project.root / "configs/pipeline.yaml").read_text() + \
        '  "train@1":\n    task: tasks.steps:train\n    outs: [models/b.json]\n'
    (project.root / "configs/pipeline.yaml").write_text(text)
    with pytest.raises(SpecError) as caught:
        load_project(project.root / "configs/pipeline.yaml")
    assert any("its item 'train@1' has the name of another stage" in i.message for i in caught.value.issues)


def test_compile_writes_one_dvc_matrix_stage_per_group(project: ProjectDir) -> None:
    loaded = _project(project)
    stages = compile_stages(loaded)["stages"]
    order = list(stages)
    assert sorted(order) == ["prepare", "shell", "stack", "train"] and order.index("stack") > order.index("train")
    assert stages["train"] == {
        "matrix": {"eta": "${sweep.etas}", "depth": [2, 4]},
        "cmd": "conveyor exec train@${key}",
        "deps": ["data/processed", "tasks/helpers.py", "tasks/steps.py"],
        "params": ["train.xgb"],
        "outs": ["models/xgb-${item.eta}-${item.depth}.json"],
        "metrics": [{"metrics/xgb-${key}.json": {"cache": False}}],
    }
    assert stages["shell"]["cmd"] == "python fit.py --model ${item.model} --rounds ${sweep.rounds} --out runs/${key}"
    assert stages["shell"]["matrix"] == {"model": ["mlp", "xgb"], "flags": [["a", "b"], {"x": 1}]}
    # the stage after the matrix depends on every item's outs, as DVC needs them spelled out
    assert [d for d in stages["stack"]["deps"] if d.startswith(("models", "metrics"))] == [
        "models/xgb-0.1-2.json", "metrics/xgb-0.1-2.json", "models/xgb-0.1-4.json", "metrics/xgb-0.1-4.json",
        "models/xgb-0.3-2.json", "metrics/xgb-0.3-2.json", "models/xgb-0.3-4.json", "metrics/xgb-0.3-4.json"]
    yaml.safe_dump(stages)  # plain data
