"""A dvc.yaml is read through DVC once per command: loading the project parses dvc.yaml and
dvc.lock and builds DVC's stages, and the run's record (under DVC's repository lock) takes
them over, unless dvc.lock was written in between, when it reads the file again. Why a stage
is stale names its paths relative to the project, wherever the command runs from.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from repos import git_dvc_init

from conveyor.dvc.record import DvcRecord
from conveyor.spec.project import load_project

DVC_YAML = """\
stages:
  one:
    cmd: echo 1 > one.txt
    outs: [one.txt]
  two:
    cmd: cat one.txt > two.txt
    deps: [one.txt]
    outs: [two.txt]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git_dvc_init(tmp_path)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    return tmp_path


def dvc(repo: Path, *args: str) -> None:
    subprocess.run(["dvc", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})


def test_loading_the_project_and_its_record_parse_each_file_once(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dvc.utils import strictyaml

    dvc(repo, "repro")
    parsed: Counter[str] = Counter()
    load = strictyaml.load

    def counting(path: str, *args: object, **kwargs: object) -> object:
        parsed[Path(path).name] += 1
        return load(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(strictyaml, "load", counting)
    project = load_project(repo / "dvc.yaml")
    record = DvcRecord(project)
    with record.session():
        assert record.recorded("one") and record.recorded("two")
        assert record.reasons("one") == [] and record.reasons("two") == []
    assert parsed == Counter({"dvc.yaml": 1, "dvc.lock": 1})


def test_the_record_reads_dvc_lock_again_when_it_was_written_after_loading(repo: Path) -> None:
    project = load_project(repo / "dvc.yaml")  # before any run: no dvc.lock
    dvc(repo, "repro")  # another command records both stages meanwhile
    record = DvcRecord(project)
    with record.session():
        assert record.recorded("one") and record.recorded("two")
        assert record.reasons("two") == []


def test_why_a_stage_is_stale_names_paths_in_the_project_from_any_working_directory(
        repo: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # DVC names paths outside the cwd as dvc.yaml does
    dvc(repo, "repro")
    (repo / "one.txt").write_text("changed\n")
    project = load_project(repo / "dvc.yaml")
    record = DvcRecord(project)
    with record.session():
        assert record.reasons("one") == ["out changed: one.txt"]
        assert record.reasons("two") == ["dep changed: one.txt"]


def test_dvc_checks_the_schema_of_a_dvc_yaml_again_only_when_its_bytes_changed(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dvc.utils import strictyaml

    from conveyor.errors import SpecError

    checked: Counter[str] = Counter()
    validate = strictyaml.validate

    def counting(data: object, schema: object, *args: object, **kwargs: object) -> object:
        checked[Path(str(kwargs.get("path"))).name] += 1
        return validate(data, schema, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(strictyaml, "validate", counting)
    load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert checked["dvc.yaml"] == 1  # the second load: the same bytes, already checked
    assert (repo / ".conveyor/dvc-schema-checked").read_text().startswith(f"{repo.resolve() / 'dvc.yaml'} sha256 ")

    (repo / "dvc.yaml").write_text(DVC_YAML.replace("outs: [one.txt]", "outs: [one.txt]\n    frozen: maybe"))
    with pytest.raises(SpecError, match="frozen"):  # a changed file is checked again
        load_project(repo / "dvc.yaml")
    assert checked["dvc.yaml"] == 2
    (repo / "dvc.yaml").write_text(DVC_YAML)  # back to the bytes that passed
    load_project(repo / "dvc.yaml")
    assert checked["dvc.yaml"] == 2
    (repo / "dvc.yaml").write_text(DVC_YAML + "  three:\n    cmd: echo 3\n")
    load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert checked["dvc.yaml"] == 3
