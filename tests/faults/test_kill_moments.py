"""kill -9 of the ``conveyor run`` runner at the moments test_kill_anywhere cannot aim at: while the
embedded Prefect server starts, inside a ``cmd`` stage, between two stages, halfway through the
outs journal's moves, and halfway through the run record's write.

The project is two ``cmd`` stages: ``first`` writes data/first.txt, ``second`` the folder
data/second (a.txt, b.txt) and data/second.sum, each the value of a param (``a``, ``b``). A
first run writes version 1; the params then say 2 and a run is killed. After each kill: every
out is version 1 or 2 and whole (never a mix), no process of the run is left, ``conveyor
status`` settles the killed run as interrupted (a run killed before its flow began has no record
yet: the last one stays), and the next run ends green without redoing what the killed run
finished, leaving no journal entry and no hidden temporary file.

The kills at a point inside conveyor (between stages, the journal, the record) are exact: the
real entry point runs in a ``python -c`` that patches the function doing that work so that it
SIGKILLs its own process there, as tests/faults/test_dvc_lock.py does for dvc.lock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from projects import Project
from repos import git_dvc_init
from subprocs import wait_until

MakeProject = Callable[[], Project]
Version1 = Callable[[bool], Path]  # the project at version 1, with DVC or without
pytestmark = pytest.mark.slow

SECOND = ("mkdir -p data/second && echo ${b} > data/second/a.txt && sh hooks.sh"
          " && echo ${b} > data/second/b.txt && echo ${b} > data/second.sum")
STAGES = f"""
  first:
    cmd: echo ${{a}} > data/first.txt
    params: [a]
    outs: [data/first.txt]
  second:
    cmd: {SECOND}
    params: [b]
    deps: [data/first.txt]
    outs: [data/second, data/second.sum]
"""
PIPELINE = "pipeline: moments\nstages:" + STAGES
DVC_YAML = "stages:" + STAGES
# Run by ``second`` after it wrote a.txt: markers in the project root make it stop there (until
# killed) or fail. Not a dep, so they change nothing that decides whether a stage is due.
HOOKS = """
    if [ -e hold ]; then echo $$ > cmd.pid; exec sleep 600; fi
    if [ -e fail ]; then echo failing on purpose >&2; exit 3; fi
"""

# The real entry point, in process: PATCH (set per test) makes it SIGKILL itself at one point.
RUN_AND_DIE = """
import os, pathlib, signal, sys
from pathlib import Path

def die():
    os.kill(os.getpid(), signal.SIGKILL)

{patch}

from conveyor.cli.app import main

sys.argv = ["conveyor", "run"]
main()
"""


@pytest.fixture(scope="module")
def version_1(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> Version1:
    """The project after a first run, at version 1; built once per kind (with DVC: dvc.yaml and
    dvc.lock, in git; without: configs/pipeline.yaml and conveyor's own record), then copied."""
    built: dict[bool, Path] = {}

    def build(dvc: bool) -> Path:
        if dvc not in built:
            root = tmp_path_factory.mktemp("version-1-dvc" if dvc else "version-1")
            tag = uuid.uuid4().hex
            project = Project(root, {**os.environ, **prefect_server, "CONVEYOR_TEST_TAG": tag}, tag)
            project.write("pyproject.toml", "[project]\nname = 'demo'\n")
            if dvc:
                git_dvc_init(root)
                project.write("dvc.yaml", DVC_YAML)
            else:
                project.write("configs/pipeline.yaml", PIPELINE)
            project.write("hooks.sh", HOOKS)
            project.write("params.yaml", "a: 1\nb: 1\n")
            first = project.conveyor("run")
            assert first.returncode == 0, first.stdout + first.stderr
            assert held(root) == {"first": "1", "second": "1"}
            built[dvc] = root
        return built[dvc]

    return build


def moments_project(make_project: MakeProject, version_1: Version1, *, dvc: bool) -> Project:
    """A copy of the project at version 1, its params then set to ``a: 2, b: 2``."""
    project = make_project()
    shutil.copytree(version_1(dvc), project.root, symlinks=True, dirs_exist_ok=True)
    project.write("params.yaml", "a: 2\nb: 2\n")
    return project


def held(root: Path) -> dict[str, str]:
    """The version each stage's outs hold; fails on an out that is partial or of mixed versions."""
    first = (root / "data/first.txt").read_text().strip()
    folder = root / "data/second"
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "b.txt"], f"data/second is partial: {folder}"
    second = {(folder / name).read_text().strip() for name in ("a.txt", "b.txt")}
    second.add((root / "data/second.sum").read_text().strip())
    assert len(second) == 1, f"the outs of second mix versions: {second}"
    return {"first": first, "second": second.pop()}


def run_killed_inside(project: Project, patch: str) -> str:
    """``conveyor run`` in process with ``patch`` applied, which kills it; the killed run's id."""
    script = RUN_AND_DIE.replace("{patch}", textwrap.dedent(patch))
    died = subprocess.run([sys.executable, "-c", script], cwd=project.root, env=project.env,
                          capture_output=True, text=True, timeout=300)
    assert died.returncode == -9, died.stdout + died.stderr
    return str(json.loads((project.root / ".conveyor/runs/latest.json").read_text())["run_id"])


def assert_settled(project: Project, run_id: str) -> dict[str, str]:
    """Nothing of the killed run runs; ``conveyor status`` records it interrupted; its stages' statuses."""
    assert not project.left_running(grace_s=5), "a process outlived the killed run"
    if (project.root / "dvc.lock").exists():
        assert isinstance(yaml.safe_load((project.root / "dvc.lock").read_text()), dict)
    status = project.conveyor("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"the last run ({run_id}) was killed" in status.stderr, status.stderr
    killed = json.loads((project.root / f".conveyor/runs/{run_id}.json").read_text())
    assert killed["status"] == "interrupted", killed
    assert project.record()["run_id"] == run_id
    return {name: stage["status"] for name, stage in killed["stages"].items()}


def rerun(project: Project, outs: dict[str, str] | None = None) -> dict[str, str]:
    """The next ``conveyor run``: it ends green with ``outs`` (default: version 2 of all) and leaves
    nothing behind; its stages' statuses."""
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert held(project.root) == (outs or {"first": "2", "second": "2"})
    assert_no_leftovers(project.root)
    return {name: stage["status"] for name, stage in project.record()["stages"].items()}


def assert_no_leftovers(root: Path) -> None:
    """No outs journal entry (hidden or not), and no hidden or temporary file among the project's files."""
    journal = root / ".conveyor/journal"
    assert not (journal.is_dir() and list(journal.iterdir())), list(journal.iterdir())
    own = [p for p in root.rglob("*") if p.relative_to(root).parts[0] not in (".git", ".dvc", ".conveyor")]
    leftovers = [p for p in own if (p.name.startswith(".") and p.name not in (".gitignore", ".dvcignore"))
                 or p.name.endswith((".tmp", ".partial"))]
    assert leftovers == [], leftovers
    temporary = [p for p in (root / ".conveyor").rglob("*.tmp")]
    assert temporary == [], temporary


def test_killed_while_the_embedded_prefect_server_starts(make_project: MakeProject, version_1: Version1,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    project = moments_project(make_project, version_1, dvc=False)
    project.write("params.yaml", "a: 1\nb: 2\n")  # only second is due
    before = project.record()["run_id"]
    # no PREFECT_API_URL: the run starts its own server (on a fresh PREFECT_HOME: its database is new)
    home = tmp_path_factory.mktemp("prefect-home")
    project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
    project.env["PREFECT_HOME"] = str(home)
    proc = project.popen("run")

    def migrating() -> list[psutil.Process]:
        """The server, once it is uvicorn (its launcher has exec'd) and has begun its new database."""
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        servers = [c for c in children if "uvicorn" in _cmdline(c)]
        return servers if (home / "prefect.db").exists() else []

    started = wait_until("the Prefect server migrating its new database", migrating, proc, every_s=0.02)
    logs = {p.name for p in (project.root / ".conveyor/logs").glob("*/*.log") if p.parent.name != before}
    assert logs <= {"prefect-server.log"}, f"the killed run went past its server's start: {logs}"
    proc.kill()
    proc.communicate(timeout=30)
    assert not project.left_running(grace_s=5), "the Prefect server (or another process) outlived the run"
    assert all_dead(started), "the Prefect server outlived the run"

    # the run wrote its record before its server started: the next command settles it
    killed = project.record()["run_id"]
    assert killed != before
    assert assert_settled(project, killed) == {"first": "not_run", "second": "not_run"}
    reasons = {s["reason"] for s in project.record()["stages"].values()}
    assert reasons == {"the run was killed before it started"}, reasons
    assert held(project.root) == {"first": "1", "second": "1"}
    # the next run starts a server on the database the killed one was migrating
    assert rerun(project, {"first": "1", "second": "2"}) == {"first": "skipped", "second": "succeeded"}


def all_dead(procs: list[psutil.Process], grace_s: float = 5) -> bool:
    """Whether all of ``procs`` have exited within ``grace_s`` (a zombie has: here nobody may reap
    an orphan; a process that is exiting may no longer show its environment to left_running)."""
    deadline = time.monotonic() + grace_s
    while not all(map(_dead, procs)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _dead(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return [str(part) for part in proc.cmdline()]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def test_killed_inside_a_command_takes_the_command_down(make_project: MakeProject, version_1: Version1) -> None:
    project = moments_project(make_project, version_1, dvc=False)
    (project.root / "hold").touch()
    proc = project.popen("run")
    pid_file = project.root / "cmd.pid"
    wait_until("second's command wrote half its outs", lambda: pid_file.exists() and pid_file.read_text().strip(), proc,
               every_s=0.02)
    command = psutil.Process(int(pid_file.read_text()))
    assert (project.root / "data/second/a.txt").read_text().strip() == "2"  # written in place, half done
    proc.kill()
    proc.communicate(timeout=30)
    assert not project.left_running(grace_s=5), "a process outlived the killed run"
    assert all_dead([command]), "the command outlived the killed run"

    run_id = project.record()["run_id"]
    assert assert_settled(project, run_id) == {"first": "succeeded", "second": "interrupted"}
    assert held(project.root) == {"first": "2", "second": "1"}
    (project.root / "hold").unlink()
    assert rerun(project) == {"first": "skipped", "second": "succeeded"}


def test_killed_between_two_stages(make_project: MakeProject, version_1: Version1) -> None:
    project = moments_project(make_project, version_1, dvc=True)
    # first's success is in dvc.lock and in the events file; second has not started
    run_id = run_killed_inside(project, """
        from conveyor.run.record import RunEvents

        stage_event = RunEvents.stage

        def dying(self, stage, record):
            stage_event(self, stage, record)
            if stage == "first" and record.status == "succeeded":
                die()

        RunEvents.stage = dying
    """)
    assert held(project.root) == {"first": "2", "second": "1"}
    assert assert_settled(project, run_id) == {"first": "succeeded", "second": "not_run"}
    assert rerun(project) == {"first": "skipped", "second": "succeeded"}


# The journal's moves, each killed halfway through second's two outs:
# aside: data/second is in the journal entry, data/second.sum not yet (the command has not run);
# back: the command failed; data/second.sum is back, data/second not yet;
# drop: the command succeeded and was recorded; the entry, holding the previous outs, is being deleted.
DYING_MOVE = """
    from conveyor.run import journal

    move = journal._move

    def dying(source, target):
        if {condition}:
            die()
        move(source, target)

    journal._move = dying
"""
JOURNAL_KILLS = {
    "aside": DYING_MOVE.format(condition='source.name == "second.sum" and ".conveyor" in target.parts'),
    "back": DYING_MOVE.format(condition='target.name == "second" and ".conveyor" in source.parts'),
    "drop": """
        import shutil

        rmtree = shutil.rmtree

        def dying(path, *args, **kwargs):
            inside = sorted(Path(path).rglob("a.txt")) if "journal" in Path(path).parts else []
            if inside:
                inside[0].unlink()  # the previous data/second, half deleted
                die()
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = dying
    """,
}
AFTER_JOURNAL_KILL = {  # (what the outs hold, the killed run's stages, the next run's stages)
    "aside": ({"first": "2", "second": "1"}, {"first": "succeeded", "second": "interrupted"},
              {"first": "skipped", "second": "succeeded"}),
    "back": ({"first": "2", "second": "1"}, {"first": "succeeded", "second": "interrupted"},
             {"first": "skipped", "second": "succeeded"}),
    "drop": ({"first": "2", "second": "2"}, {"first": "succeeded", "second": "interrupted"},
             {"first": "skipped", "second": "skipped"}),
}


@pytest.mark.parametrize("when", JOURNAL_KILLS)
def test_killed_halfway_through_the_outs_journal(make_project: MakeProject, version_1: Version1, when: str) -> None:
    project = moments_project(make_project, version_1, dvc=True)
    if when == "back":
        (project.root / "fail").touch()
    run_id = run_killed_inside(project, JOURNAL_KILLS[when])
    assert list((project.root / ".conveyor/journal").iterdir()), "the kill did not land in the journal"
    outs, killed, next_run = AFTER_JOURNAL_KILL[when]
    assert assert_settled(project, run_id) == killed
    assert held(project.root) == outs
    (project.root / "fail").unlink(missing_ok=True)
    assert rerun(project) == next_run


# Half of the record's final text written (the run has ended), then killed: into <run_id>.json,
# or into latest.json after <run_id>.json was written whole.
RECORD_KILL = """
    write_text = pathlib.Path.write_text

    def dying(self, text, *args, **kwargs):
        temporary = self.parent.name == "runs" and self.name.endswith(".tmp")
        final = '"status": "running"' not in text
        if temporary and final and self.name.startswith(".latest.json") == LATEST:
            with open(self, "w", encoding="utf-8") as fh:
                fh.write(text[: len(text) // 2])
            die()
        return write_text(self, text, *args, **kwargs)

    pathlib.Path.write_text = dying
"""


@pytest.mark.parametrize("target", ["run_id", "latest"])
def test_killed_while_writing_the_run_record(make_project: MakeProject, version_1: Version1, target: str) -> None:
    project = moments_project(make_project, version_1, dvc=True)
    run_id = run_killed_inside(project, f"LATEST = {target == 'latest'}\n" + textwrap.dedent(RECORD_KILL))
    runs = project.root / ".conveyor/runs"
    assert [p.name for p in runs.glob(".*.tmp")] != [], "the kill did not land in the record's write"
    whole = json.loads((runs / f"{run_id}.json").read_text())  # the text before, or the whole new one
    assert whole["status"] == ("succeeded" if target == "latest" else "running")
    assert held(project.root) == {"first": "2", "second": "2"}
    assert assert_settled(project, run_id) == {"first": "succeeded", "second": "succeeded"}
    assert rerun(project) == {"first": "skipped", "second": "skipped"}
