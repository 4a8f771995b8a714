"""`conveyor exec STAGE` (what `dvc repro` runs for a stage): one line on stderr says how the
stage ended and where its log is, where it printed nothing of its own before."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SPEC = """\
pipeline: one
stages:
  hello: {cmd: echo hello > a.txt && echo said hello, outs: [a.txt]}
  fail: {cmd: "echo bad input >&2 && exit 3", outs: [b.txt]}
  boom: {task: "tasks.steps:boom", outs: [c.txt]}
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'one'\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text(SPEC)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks/__init__.py").write_text("")
    (tmp_path / "tasks/steps.py").write_text("def boom(ctx):\n    raise ValueError('3 rows: too few')\n")
    return tmp_path


def conveyor_exec(root: Path, stage: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["conveyor", "exec", stage], cwd=root, capture_output=True, text=True, timeout=120)


def test_exec_says_the_stage_succeeded_and_where_its_log_is(project: Path) -> None:
    done = conveyor_exec(project, "hello")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "said hello\n"  # the command's own output, as it printed it
    assert re.fullmatch(r"hello: succeeded in \d+\.\ds on local; its log: (\.conveyor/logs/\S+/hello\.log)\n",
                        done.stderr), done.stderr
    log = project / done.stderr.rsplit(": ", 1)[1].strip()
    assert "said hello" in log.read_text()


@pytest.mark.parametrize(("stage", "why"), [
    ("fail", "command exited with status 3"),  # its stderr is on the terminal already, above
    ("boom", "ValueError: 3 rows: too few"),
])
def test_exec_says_in_one_line_how_the_stage_failed(project: Path, stage: str, why: str) -> None:
    done = conveyor_exec(project, stage)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"stage '{stage}' failed: {re.escape(why)} \(after \d+\.\ds\); its log: "
                        rf"\.conveyor/logs/\S+/{stage}\.log", last), done.stderr
