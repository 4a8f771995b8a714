"""`conveyor compile` never replaces a dvc.yaml it did not write.

A dvc.yaml written by hand (metrics, plots, artifacts conveyor knows nothing of) is the
user's: compile and compile --check refuse it with exit 2 and leave it as it was, byte for
byte and mtime. A dvc.yaml that conveyor compiled earlier, from any spec, is replaced.
Runs the installed console script in a real git + DVC repository; no Prefect server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from repos import git_dvc_init

from conveyor.dvc.compile import HEADER, written_by_conveyor

CONVEYOR = shutil.which("conveyor")
pytestmark = pytest.mark.skipif(CONVEYOR is None, reason="the conveyor console script is not installed")

SPEC = """\
pipeline: tiny
stages:
  prepare: {cmd: "echo prepared > prepared.txt", outs: [prepared.txt]}
  score: {cmd: "echo '{\\"acc\\": 1}' > score.json", deps: [prepared.txt], metrics: [score.json]}
"""

HAND_WRITTEN = """\
stages:
  prepare:
    cmd: echo prepared > prepared.txt
    outs: [prepared.txt]
metrics:
  - score.json
plots:
  - score.json
"""

OLD_MTIME_NS = 1_600_000_000 * 10**9  # far from now: a write of any kind would move it


def conveyor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert CONVEYOR is not None
    return subprocess.run([CONVEYOR, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A conveyor project in a git + DVC repository (both initialised by their own CLIs)."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'tiny'\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text(SPEC)
    git_dvc_init(tmp_path)
    return tmp_path


def hand_written(root: Path) -> Path:
    path = root / "dvc.yaml"
    path.write_text(HAND_WRITTEN)
    os.utime(path, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    return path


@pytest.mark.parametrize("args", [(), ("--check",)], ids=["compile", "check"])
def test_compile_refuses_a_hand_written_dvc_yaml_and_leaves_it_as_it_was(tiny: Path, args: tuple[str, ...]) -> None:
    path = hand_written(tiny)
    before = path.read_bytes()

    done = conveyor("compile", *args, cwd=tiny)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""  # no drift diff for --check either
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("dvc.yaml was not written by `conveyor compile`")
    assert "`conveyor run -c dvc.yaml` runs it as it is" in line  # way on 1: use it as the source
    assert "move it aside (`mv dvc.yaml dvc.yaml.orig`) and run `conveyor compile` again" in line  # way on 2
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == OLD_MTIME_NS
    assert sorted(p.name for p in tiny.iterdir()) == [".dvc", ".dvcignore", ".git", "configs", "dvc.yaml",
                                                       "pyproject.toml"]  # no temporary file, no dvc.lock


def test_compile_refuses_from_a_subdirectory_naming_the_file_by_its_full_path(tiny: Path) -> None:
    path = hand_written(tiny)
    (tiny / "configs" / "notes").mkdir()

    done = conveyor("compile", cwd=tiny / "configs" / "notes")

    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"{path} was not written by `conveyor compile`")
    assert f"`conveyor run -c {path}`" in done.stderr
    assert path.read_text() == HAND_WRITTEN


def test_compile_replaces_a_dvc_yaml_it_wrote_even_from_another_spec(tiny: Path) -> None:
    path = tiny / "dvc.yaml"
    path.write_text(HEADER.format(spec="configs/old.yaml") + "stages:\n  gone:\n    cmd: echo gone\n")

    done = conveyor("compile", cwd=tiny)

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote dvc.yaml (2 stages) from configs/pipeline.yaml")
    text = path.read_text()
    assert text.startswith(HEADER.format(spec="configs/pipeline.yaml"))
    assert "gone" not in text and "prepare:" in text and "score.json:\n        cache: false" in text
    assert conveyor("compile", "--check", cwd=tiny).returncode == 0
    assert conveyor("compile", cwd=tiny).returncode == 0  # and again over its own


def test_compile_check_on_a_dvc_yaml_it_wrote_still_reports_drift(tiny: Path) -> None:
    path = tiny / "dvc.yaml"
    path.write_text(HEADER.format(spec="configs/pipeline.yaml") + "stages: {}\n")

    done = conveyor("compile", "--check", cwd=tiny)

    assert done.returncode == 1
    assert "+++ dvc.yaml (from the spec)" in done.stdout
    assert "dvc.yaml is out of date with configs/pipeline.yaml" in done.stderr


@pytest.mark.parametrize(("text", "expected"), [
    (HEADER.format(spec="configs/pipeline.yaml") + "stages: {}\n", True),
    (HEADER.format(spec="../elsewhere/spec.yaml"), True),
    (HEADER.format(spec="configs/pipeline.yaml").replace("\n", "\r\n") + "stages: {}\r\n", True),
    (HAND_WRITTEN, False),
    ("", False),
    ("# my notes\n" + HEADER.format(spec="configs/pipeline.yaml"), False),  # the header on line 2 is not it
    (HEADER.format(spec=""), False),
    ("# Generated by hand: edit the spec, not this file.\n", False),
], ids=["this-spec", "another-spec", "crlf", "hand-written", "empty", "second-line", "no-spec", "lookalike"])
def test_written_by_conveyor_reads_only_the_first_line(tmp_path: Path, text: str, expected: bool) -> None:
    path = tmp_path / "dvc.yaml"
    path.write_bytes(text.encode())

    assert written_by_conveyor(path) is expected


def test_written_by_conveyor_is_false_for_what_is_not_a_file(tmp_path: Path) -> None:
    assert not written_by_conveyor(tmp_path / "dvc.yaml")
    (tmp_path / "dvc.yaml").mkdir()
    assert not written_by_conveyor(tmp_path / "dvc.yaml")
