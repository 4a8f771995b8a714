"""DVC's "up to date" for a stage is kept with the size, mtime and inode of every file it was
decided on (deps, outs, each file of a folder, the outs' cache objects), and answers again
without DVC while they and the files the project was read from are the same; any change has
DVC asked, and the answer is DVC's."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from projects import age
from repos import git_dvc_init

from conveyor.dvc import record as dvc_record
from conveyor.dvc.stamps import FILE
from conveyor.dvc.status import stale
from conveyor.spec.project import load_project
from conveyor.workspace import STATE_DIR

DVC_YAML = """\
stages:
  prepare:
    cmd: mkdir -p out && cat data/raw/*.csv > out/all.csv
    deps: [data/raw]
    outs: [out/all.csv]
  report:
    cmd: wc -l out/all.csv > report.txt && echo ${threshold} >> report.txt
    deps: [out/all.csv]
    params: [threshold]
    outs: [report.txt]
"""


def dvc(root: Path, *args: str) -> None:
    subprocess.run(["dvc", *args], cwd=root, check=True, capture_output=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "project"
    (root / "data" / "raw").mkdir(parents=True)
    git_dvc_init(root)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "params.yaml").write_text("threshold: 0.5\n")
    (root / "data" / "raw" / "a.csv").write_text("x\n1\n")
    dvc(root, "repro")
    (root / STATE_DIR).mkdir(exist_ok=True)
    age(root)
    return root


def ask(root: Path) -> dict[str, list[str]]:
    project = load_project(root / "dvc.yaml")
    return stale(project, set(project.order))


@pytest.fixture
def dvc_asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stages whose status DVC was asked for."""
    asked: list[str] = []
    real = dvc_record.stage_status

    def counting(stage: object) -> object:
        asked.append(str(getattr(stage, "name", stage)))
        return real(stage)  # type: ignore[arg-type]

    monkeypatch.setattr(dvc_record, "stage_status", counting)
    return asked


def test_an_untouched_pipeline_is_answered_from_what_dvc_said(repo: Path, dvc_asked: list[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert ask(repo) == {"prepare": [], "report": []}
    assert sorted(dvc_asked) == ["prepare", "report"]
    assert (repo / STATE_DIR / FILE).is_file()
    from dvc import dvcfile

    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("DVC read the pipeline")

    monkeypatch.setattr(dvcfile, "load_file", never)
    assert ask(repo) == {"prepare": [], "report": []}
    assert sorted(dvc_asked) == ["prepare", "report"]  # not again


@pytest.mark.parametrize("change", ["an out rewritten", "a file added to a folder dep", "a file of a folder dep",
                                    "an out's cache object gone", "a param", "the command", "an out removed"])
def test_any_change_is_dvcs_to_judge(repo: Path, dvc_asked: list[str], change: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ask(repo)
    ask(repo)
    assert len(dvc_asked) == 2
    if change == "an out rewritten":
        (repo / "report.txt").write_text("other\n")
    elif change == "a file added to a folder dep":
        (repo / "data" / "raw" / "b.csv").write_text("x\n2\n")
    elif change == "a file of a folder dep":
        (repo / "data" / "raw" / "a.csv").write_text("x\n9\n")
    elif change == "an out's cache object gone":
        shutil.rmtree(repo / ".dvc" / "cache")
    elif change == "a param":
        (repo / "params.yaml").write_text("threshold: 0.7\n")
    elif change == "the command":
        (repo / "dvc.yaml").write_text(DVC_YAML.replace("wc -l", "wc -c"))
    else:
        (repo / "out" / "all.csv").unlink()
    found = ask(repo)
    assert len(dvc_asked) > 2, "DVC was not asked"
    monkeypatch.setenv("CONVEYOR_SNAPSHOT", "0")  # DVC alone: no snapshot, so no kept answers
    assert found == ask(repo) and any(found.values()), change


def test_what_was_written_in_the_instant_of_the_check_is_not_kept(repo: Path, dvc_asked: list[str]) -> None:
    ask(repo)
    report = repo / "report.txt"
    report.write_text(report.read_text())  # the same bytes
    # its mtime in the instant of the checks below, however long they take on a loaded machine
    # (written now, it was not: a check 50 ms later, FINE_S, could prove it unchanged)
    soon = time.time() + 20
    os.utime(report, (soon, soon))
    assert ask(repo) == {"prepare": [], "report": []}
    assert dvc_asked.count("report") == 2
    ask(repo)
    assert dvc_asked.count("report") == 3  # its mtime too close to the check to prove anything
    age(repo, 30, folders=False)
    ask(repo)
    ask(repo)
    assert dvc_asked.count("report") == 4


def test_a_pipeline_dvc_recorded_since_is_asked_again(repo: Path, dvc_asked: list[str]) -> None:
    ask(repo)
    (repo / "data" / "raw" / "a.csv").write_text("x\n5\n")
    dvc(repo, "repro")  # dvc.lock written: every kept answer was decided on the old one
    age(repo, 30)
    asked = len(dvc_asked)
    assert ask(repo) == {"prepare": [], "report": []}
    assert len(dvc_asked) == asked + 2


def test_a_command_that_uses_nothing_kept_leaves_what_was_kept(repo: Path, dvc_asked: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ask(repo)
    ask(repo)
    assert len(dvc_asked) == 2
    monkeypatch.setenv("CONVEYOR_SNAPSHOT", "0")
    assert ask(repo) == {"prepare": [], "report": []}
    assert len(dvc_asked) == 4  # DVC alone
    monkeypatch.delenv("CONVEYOR_SNAPSHOT")
    assert ask(repo) == {"prepare": [], "report": []}
    assert len(dvc_asked) == 4
