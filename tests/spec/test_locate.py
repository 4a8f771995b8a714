"""``locate``: where a spec lives and its pipeline's name, found without loading its stages (what
``conveyor runs`` and ``compare`` need), the same as loading the project finds them: a conveyor
spec, a dvc.yaml at a DVC repository's root or below it, a placement spec; a spec whose place
is not plain (no DVC repository) is loaded, and its error raised."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from repos import git_dvc_init

from conveyor.errors import SpecError
from conveyor.spec.project import Project, load_project, locate

if TYPE_CHECKING:
    from conftest import ProjectDir

DVC_YAML = "stages:\n  one:\n    cmd: echo 1 > one.txt\n    outs: [one.txt]\n"


def same_as_loaded(spec: Path) -> None:
    place, name = locate(spec)
    project = load_project(spec)
    assert not isinstance(place, Project), "located by loading the project"
    assert (place.root, place.spec_path, name) == (project.root, project.spec_path, project.pipeline.pipeline)
    assert place.spec_option == project.spec_option


def repo(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    git_dvc_init(root)
    return root


def test_a_conveyor_spec(project: ProjectDir) -> None:
    same_as_loaded(project.good_spec())


def test_a_dvc_yaml_at_the_root_and_below_it(tmp_path: Path) -> None:
    root = repo(tmp_path.resolve() / "proj")
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "sub").mkdir()
    (root / "sub" / "dvc.yaml").write_text(DVC_YAML)
    same_as_loaded(root / "dvc.yaml")
    same_as_loaded(root / "sub" / "dvc.yaml")
    assert locate(root / "sub" / "dvc.yaml")[0].root == root


def test_a_placement_spec_named_or_not(tmp_path: Path) -> None:
    root = repo(tmp_path.resolve() / "proj")
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "placed.yaml").write_text("dvc: dvc.yaml\n")
    (root / "named.yaml").write_text("pipeline: nightly\ndvc: dvc.yaml\n")
    same_as_loaded(root / "placed.yaml")
    same_as_loaded(root / "named.yaml")
    assert locate(root / "named.yaml")[1] == "nightly"


def test_a_dvc_yaml_outside_a_dvc_repository_raises_what_loading_raises(tmp_path: Path) -> None:
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    with pytest.raises(SpecError, match="is not in a DVC repository"):
        locate(tmp_path / "dvc.yaml")
