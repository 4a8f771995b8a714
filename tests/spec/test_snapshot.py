"""A dvc.yaml project is loaded from the snapshot of its last load while nothing that load read
has changed, and loaded anew (by DVC) as soon as anything did: the files' bytes, a file added
where DVC looks for DVC files, git's ignore rules, the placement spec; a load during which a
folder changed keeps nothing. The snapshot is the user's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from projects import age
from repos import git_dvc_init

from conveyor.spec import dvcyaml, snapshot
from conveyor.spec.project import Project, load_project
from conveyor.workspace import state_dir

DVC_YAML = """\
vars: [config.yaml]
stages:
  make:
    cmd: echo ${size} > data/made.txt
    deps: [data/raw]
    outs: [data/made.txt]
  report:
    cmd: cat data/made.txt > report.txt
    deps: [data/made.txt]
    params: [threshold]
    outs: [report.txt]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    git_dvc_init(root)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "config.yaml").write_text("size: 3\n")
    (root / "params.yaml").write_text("threshold: 0.5\n")
    (root / "data" / "raw").mkdir(parents=True)
    (root / "data" / "raw" / "a.csv").write_text("x\n1\n")
    state_dir(root)  # made by the first command (a new entry of the root: that load keeps nothing)
    age(root)
    return root


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The loads DVC did (not answered by a snapshot)."""
    done: list[Path] = []
    real = dvcyaml._load

    def counting(dvc_file: Path, *args: object, **kwargs: object) -> Project:
        done.append(dvc_file)
        return real(dvc_file, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dvcyaml, "_load", counting)
    return done


def test_an_unchanged_project_is_loaded_from_its_snapshot_as_dvc_loaded_it(repo: Path, loads: list[Path]) -> None:
    first = load_project(repo / "dvc.yaml")
    second = load_project(repo / "dvc.yaml")
    assert len(loads) == 1
    assert second == first and second.order == first.order
    assert second.pipeline.stages["make"].cmd == "echo 3 > data/made.txt"
    assert second.dvc is not None and first.dvc is not None
    assert second.dvc.params == first.dvc.params and second.dvc.inputs == first.dvc.inputs
    assert second.dvc.loaded is None  # DVC's repository is opened by the record that needs it
    kept = list(snapshot.cache_dir().glob("*.pickle"))
    assert kept and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in kept)
    assert stat.S_IMODE(snapshot.cache_dir().stat().st_mode) == 0o700


RAW_DVC = "outs:\n- md5: d41d8cd98f00b204e9800998ecf8427e.dir\n  path: ../data/raw\n"


@pytest.mark.parametrize("change", ["dvc.yaml", "vars file", "params.yaml", "a .dvc file added",
                                    "a .dvc file ignored by git", "a file added anywhere DVC looked"])
def test_any_change_to_what_the_load_read_loads_again(repo: Path, loads: list[Path], change: str) -> None:
    (repo / "sub").mkdir()
    if change == "a .dvc file ignored by git":
        (repo / "sub" / "raw.dvc").write_text(RAW_DVC)
        (repo / ".gitignore").write_text("/other\n")
    age(repo)
    first = load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert len(loads) == 1
    if change == "dvc.yaml":  # same size, same mtime: the bytes decide
        before = (repo / "dvc.yaml").stat()
        (repo / "dvc.yaml").write_text(DVC_YAML.replace("echo ${size}", "ECHO ${size}"))
        os.utime(repo / "dvc.yaml", ns=(before.st_atime_ns, before.st_mtime_ns))
    elif change == "vars file":
        (repo / "config.yaml").write_text("size: 4\n")
    elif change == "params.yaml":
        (repo / "params.yaml").write_text("threshold: 0.7\n")
    elif change == "a .dvc file added":  # in a folder DVC's walk listed: now upstream data
        (repo / "sub" / "raw.dvc").write_text(RAW_DVC)
    elif change == "a .dvc file ignored by git":  # in place: the folders stay as they were
        (repo / ".gitignore").write_text("/sub/raw.dvc\n")
    else:
        (repo / "sub" / "notes.txt").write_text("x\n")
    in_place = change in ("dvc.yaml", "vars file", "params.yaml", "a .dvc file ignored by git")
    age(repo, 30, folders=not in_place)  # a file added: its folder's mtime moved (and is old enough)
    again = load_project(repo / "dvc.yaml")
    assert len(loads) == 2
    assert first.dvc is not None and again.dvc is not None
    if change == "vars file":
        assert again.pipeline.stages["make"].cmd == "echo 4 > data/made.txt"
    elif change == "dvc.yaml":
        assert again.pipeline.stages["make"].cmd == "ECHO 3 > data/made.txt"
    elif change == "a .dvc file added":
        assert again.dvc.sources["make"] == ("sub/raw.dvc",)
    elif change == "a .dvc file ignored by git":
        assert first.dvc.sources["make"] == ("sub/raw.dvc",) and again.dvc.sources["make"] == ()
    load_project(repo / "dvc.yaml")
    assert len(loads) == 2  # and kept again


def test_a_placement_spec_is_part_of_what_was_read(repo: Path, loads: list[Path]) -> None:
    spec = repo / "conveyor.yaml"
    spec.write_text("dvc: dvc.yaml\nplacement:\n  make: {retries: 1}\n")
    age(repo)
    assert load_project(spec).pipeline.stages["make"].retries == 1
    assert load_project(spec).pipeline.stages["make"].retries == 1
    assert len(loads) == 1
    spec.write_text("dvc: dvc.yaml\nplacement:\n  make: {retries: 2}\n")
    assert load_project(spec).pipeline.stages["make"].retries == 2
    assert len(loads) == 2


def test_a_load_right_after_a_folder_changed_keeps_nothing(repo: Path, loads: list[Path]) -> None:
    (repo / "data" / "raw" / "b.csv").write_text("x\n2\n")  # now: the listing cannot prove what came after
    load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert len(loads) == 2
    age(repo)
    load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert len(loads) == 3


def test_a_snapshot_another_user_could_have_written_or_a_damaged_one_is_not_read(
        repo: Path, loads: list[Path]) -> None:
    load_project(repo / "dvc.yaml")
    (kept,) = snapshot.cache_dir().glob("*.pickle")
    kept.chmod(0o666)
    load_project(repo / "dvc.yaml")
    assert len(loads) == 2
    (kept,) = snapshot.cache_dir().glob("*.pickle")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # written again, the user's alone
    kept.write_bytes(kept.read_bytes()[:100])
    load_project(repo / "dvc.yaml")
    assert len(loads) == 3


def test_turned_off_no_snapshot_is_read_or_written(repo: Path, loads: list[Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_SNAPSHOT", "0")
    load_project(repo / "dvc.yaml")
    load_project(repo / "dvc.yaml")
    assert len(loads) == 2
    assert not list(snapshot.cache_dir().glob("*.pickle"))


def test_a_read_the_hook_cannot_note_fails_nothing_and_keeps_nothing(repo: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit hook that raises fails what it audits: a listing in a working folder another
    process removed (its absolute path cannot be known) goes on as without the hook."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with snapshot.recording() as reads:
        assert os.listdir(".") == []  # what Linux lists in a removed folder
    assert reads.lost
    monkeypatch.chdir(repo)
    assert snapshot.Snapshot(repo / "dvc.yaml", None, False).keep(load_project(repo / "dvc.yaml"), reads, 0) is None


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
