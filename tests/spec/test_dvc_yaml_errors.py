"""A dvc.yaml conveyor cannot take, and a placement spec with a mistake: every problem named
with file, line and key (SPEC.md §2.3), read in-process through DVC's own loader.

One DVC repository for the module (git and DVC initialised once); each case is a dvc.yaml
in a folder of its own, as a monorepo has them.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from repos import git_dvc_init

from conveyor.errors import SpecError
from conveyor.spec.project import load_project


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dvc-repo")
    git_dvc_init(root)
    return root


@pytest.fixture
def folder(repo: Path) -> Iterator[Path]:
    """A folder of its own in the shared repository; its dvc.yaml set aside afterwards, since DVC
    (and conveyor, as `dvc repro` does) reads every dvc.yaml of the repository, broken ones too."""
    folder = repo / f"case-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    if (folder / "dvc.yaml").exists():
        (folder / "dvc.yaml").rename(folder / "dvc.yaml.done")


@pytest.mark.parametrize(("dvc_yaml", "placement", "expected"), [
    ("stages:\n  a:\n    cmd: echo ${nope}\n", None, "dvc.yaml:3 stages.a.cmd: Could not find 'nope'"),
    ("stages:\n  a:\n    cmd: echo hi\n    outz: [x]\n", None, "dvc.yaml:4 stages.a.outz: unknown key 'outz'"),
    # the problem is ruamel's words, which differ with and without its C loader (optional since 0.19)
    ("stages:\n  a:\n    cmd: [echo hi\n", None, "dvc.yaml:4 not valid YAML: "),
    ("stages:\n  a:\n    cmd: echo hi\n    outs: [/tmp/elsewhere.txt]\n", None,
     "stages.a.outs: '/tmp/elsewhere.txt' lies outside the repository"),
    ("stages:\n  a:\n    cmd: echo a\n    outs: [x]\n  b:\n    cmd: echo b\n    outs: [x]\n", None,
     "is specified in: - "),
    ("stages:\n  train:\n    cmd: echo hi\n", "dvc: dvc.yaml\nplacement:\n  trian: {on: gpu}\n",
     "placed.yaml:3 placement.trian: matches no stage of dvc.yaml (did you mean 'train'?)"),
    ("stages:\n  train:\n    cmd: echo hi\n", "dvc: dvc.yaml\nplacement:\n  train: {on: gpu}\n",
     "placed.yaml:3 placement.train.on: unknown profile 'gpu'"),
    ("stages:\n  train:\n    cmd: echo hi\n", "dvc: dvc.yaml\nplacement:\n  train: {onn: cpu}\n",
     "placed.yaml:3 placement.train.onn: unknown key 'onn' (did you mean 'on'?)"),
])
def test_a_dvc_yaml_conveyor_cannot_honour_is_an_error_naming_it(
        folder: Path, dvc_yaml: str, placement: str | None, expected: str) -> None:
    (folder / "dvc.yaml").write_text(dvc_yaml)
    spec = folder / "dvc.yaml"
    if placement is not None:
        spec = folder / "placed.yaml"
        spec.write_text(placement)
    with pytest.raises(SpecError) as info:
        load_project(spec)
    assert info.value.exit_code == 2
    assert expected in str(info.value), str(info.value)


def test_a_placement_spec_places_matrix_items_by_glob(folder: Path) -> None:
    (folder / "dvc.yaml").write_text("stages:\n  train:\n    matrix:\n      lr: [1, 2]\n"
                                     "    cmd: echo ${item.lr}\n  report:\n    cmd: echo done\n")
    (folder / "placed.yaml").write_text(
        "dvc: dvc.yaml\nprofiles:\n  io: {kind: threads}\nplacement:\n"
        "  '*': {timeout_s: 60}\n  'train@*': {on: io, retries: 2}\n  'train@2': {timeout_s: 5}\n")
    project = load_project(folder / "placed.yaml")
    stages = project.pipeline.stages
    assert list(stages) == ["train@1", "train@2", "report"]
    assert (stages["train@1"].on, stages["train@1"].retries, stages["train@1"].timeout_s) == ("io", 2, 60)
    assert (stages["train@2"].on, stages["train@2"].timeout_s) == ("io", 5)  # later globs override
    assert (stages["report"].on, stages["report"].timeout_s) == (None, 60)
    assert project.expand(["train"]) == ["train@1", "train@2"]
    assert stages["train@1"].wdir == folder.name and stages["train@1"].cmd == "echo 1"


def test_a_dvc_project_outside_git_is_an_error_saying_what_to_do(tmp_path: Path) -> None:
    git_dvc_init(tmp_path)
    shutil.rmtree(tmp_path / ".git")  # .dvc/ copied without its git repository
    (tmp_path / "dvc.yaml").write_text("stages:\n  a: {cmd: echo a > a.txt, outs: [a.txt]}\n")
    with pytest.raises(SpecError) as info:
        load_project(tmp_path / "dvc.yaml")
    assert info.value.exit_code == 2
    assert f"dvc.yaml is not in a git repository: DVC keeps its record beside git; run `git init` in {tmp_path}" \
        in str(info.value)
