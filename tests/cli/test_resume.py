"""`resume with:` under a run's summary: the command that finishes what the run began, with the
options it ran with. A forced run resumed without --force would skip what it had not reached."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from conveyor.cli.view import resume_command, resume_interrupted
from conveyor.run.record import RunRecord, StageRecord
from conveyor.run.session import RunOptions
from conveyor.spec.project import Project, load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

# c, then a and b after it
SPEC = """
    pipeline: resume
    profiles:
      cpu: {kind: dask, n_workers: 1}
      remote: {kind: dask, address: "tcp://127.0.0.1:8786"}
    stages:
      c: {cmd: echo c > c.txt, outs: [c.txt]}
      a: {cmd: cat c.txt > a.txt, deps: [c.txt], outs: [a.txt], on: cpu}
      b: {cmd: cat c.txt > b.txt, deps: [c.txt], outs: [b.txt]}
"""


@pytest.fixture
def loaded(project: ProjectDir) -> Project:
    return load_project(project.spec(SPEC))


def ended(**statuses: str) -> RunRecord:
    return RunRecord("20260101T000000-aaaaaa", "resume", stages={n: StageRecord(status=s) for n, s in statuses.items()})


def test_an_interrupted_forced_run_resumes_what_it_had_not_finished_forced(loaded: Project) -> None:
    run = ended(c="succeeded", a="interrupted", b="not_run")
    assert resume_interrupted(loaded, run, RunOptions(force=True)) == "conveyor run a b -s --force"
    # stopped before anything finished: the run as it was given
    run = ended(c="interrupted", a="not_run", b="not_run")
    assert resume_interrupted(loaded, run, RunOptions(("a",), force=True)) == "conveyor run a --force"


def test_an_interrupted_run_resumes_with_its_selection_and_profiles(loaded: Project) -> None:
    run = ended(c="succeeded", a="interrupted")
    options = RunOptions(("a",), profiles={"cpu": "remote"})
    assert resume_interrupted(loaded, run, options) == "conveyor run a --profile cpu=remote"
    assert resume_interrupted(loaded, run, RunOptions(("c",), downstream=True)) == "conveyor run c --downstream"
    assert resume_interrupted(loaded, run, RunOptions(("a",), single=True)) == "conveyor run a -s"


def test_a_failed_forced_run_resumes_forced(loaded: Project) -> None:
    run = ended(c="succeeded", a="failed", b="succeeded")
    assert resume_command(loaded, run, RunOptions(force=True)) == "conveyor run a --downstream --force"
    assert resume_command(loaded, run, RunOptions()) == "conveyor run a --downstream"
    assert resume_command(loaded, ended(c="succeeded"), RunOptions(force=True)) is None
