"""What a task starts and leaves running ends with the command that ran it, as a cmd stage's does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
from projects import Project

SPEC = """
    pipeline: leftovers
    stages:
      spawn: {task: tasks.work:spawn, outs: [data/pids.json]}
"""
WORK = """
    import json
    import multiprocessing
    import subprocess
    import sys
    import time

    import psutil

    NAP = "import time; time.sleep(600)"
    PARENT = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]]); time.sleep(600)"


    def spawn(ctx):
        started = [subprocess.Popen([sys.executable, "-c", NAP]),  # never waited for
                   subprocess.Popen([sys.executable, "-c", PARENT, NAP], start_new_session=True)]  # with a child
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        forked.start()  # never joined: multiprocessing's exit handler would wait for it at the run's end
        while not psutil.Process(started[1].pid).children():  # its child started
            time.sleep(0.05)
        ctx.out().write_text(json.dumps([p.pid for p in started] + [forked.pid]))
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _project(make_project: Callable[[], Project], spec: str, work: str) -> Project:
    project = make_project()
    project.write("configs/pipeline.yaml", spec)
    project.write("tasks/__init__.py", "")
    project.write("tasks/work.py", work)
    return project


def test_processes_a_task_left_running_end_with_the_run_and_with_exec(make_project: Callable[[], Project]) -> None:
    project = _project(make_project, SPEC, WORK)
    for command in (["run"], ["exec", "spawn"]):  # `dvc repro` calls `conveyor exec`
        done = project.conveyor(*command, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        pids = json.loads((project.root / "data/pids.json").read_text())
        assert "ended 4 processes a task started and left running: " in done.stderr, done.stderr
        assert "(a task waits for what it starts, or runs it as a cmd stage)" in done.stderr
        assert [pid for pid in pids if _running(pid)] == [], command
        assert project.left_running() == [], command


FLOW = """
import json, subprocess, sys
from prefect import flow
import conveyor

@flow
def mine():
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the flow's, not the run's
    state = conveyor.run_stages("configs/pipeline.yaml", force=True)
    print(json.dumps({"own": own.pid, "own_running": own.poll() is None, "completed": state.is_completed()}))
    own.kill()

mine()
"""


def test_in_a_flow_of_the_users_what_the_run_left_ends_and_what_the_flow_started_before_stays(
        make_project: Callable[[], Project]) -> None:
    """A deployment's flow calling conveyor.run_stages: the flow's own processes are not the run's."""
    project = _project(make_project, SPEC, WORK)
    done = subprocess.run([sys.executable, "-c", FLOW], cwd=project.root, env=project.env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["own_running"] and seen["completed"], seen
    pids = json.loads((project.root / "data/pids.json").read_text())
    assert [pid for pid in pids if _running(pid)] == []
    assert "ended 4 processes a task started and left running: " in done.stdout + done.stderr


HOLD = """
    import multiprocessing
    import subprocess
    import sys
    import time
    from pathlib import Path


    def hold(ctx):
        started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        # a fork without an exec: its environment is that of the process the run was forked from
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        forked.start()
        Path(ctx.root / "started.pid").write_text(f"{started.pid} {forked.pid}")
        time.sleep(600)
"""


HOLDING = "pipeline: killed\nstages:\n  hold: {task: tasks.work:hold, outs: [o]}\n"


def _killed_while_holding(project: Project, proc: subprocess.Popen[Any], victim: Callable[[], int]) -> list[int]:
    """Once ``hold`` has started its processes, SIGKILL the process ``victim()`` names and wait for
    ``proc``; the pids the task started, which the kill left running."""
    try:
        deadline = time.monotonic() + 120
        while not (project.root / "started.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended, or its task never started"
            time.sleep(0.05)
        os.kill(victim(), signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    started = [int(pid) for pid in (project.root / "started.pid").read_text().split()]
    assert all(_running(pid) for pid in started)  # the kill left them
    return started


def _ended_by_the_next_command(project: Project, started: list[int]) -> tuple[str, str]:
    """``conveyor status`` after the kill: it ends what the killed run left; its stderr and that line."""
    status = project.conveyor("status")
    assert status.returncode == 0, status.stdout + status.stderr
    said = next(line for line in status.stderr.splitlines() if "the killed run had left running" in line)
    assert said.startswith("ended 2 processes the killed run had left running: ") \
        and all(f"{pid} (" in said for pid in started), status.stderr
    assert not any(_running(pid) for pid in started)
    return status.stderr, said


def test_what_a_killed_runs_tasks_left_running_ends_with_the_next_command(make_project: Callable[[], Project]) -> None:
    """kill -9 of the run (or the OOM killer): nothing of it can end what its tasks started; the next
    command, which settles the killed run's record, does. The task's fork kept neither the run lock
    nor DVC's meanwhile: DVC answers at once, and the next command can settle the run."""
    project = _project(make_project, HOLDING, HOLD)
    project.init_dvc()
    assert project.conveyor("compile").returncode == 0  # dvc.lock is the record: the run holds DVC's lock
    run = project.popen("run")
    started = _killed_while_holding(project, run, lambda: project.run_pid(run))
    dvc = project.sh("dvc", "status", check=False)
    assert dvc.returncode == 0 and "hold" in dvc.stdout, dvc.stdout + dvc.stderr  # not "Unable to acquire lock"

    stderr, said = _ended_by_the_next_command(project, started)
    assert "the last run" in stderr and "was killed while hold ran" in stderr, stderr
    assert f"{started[1]} (forked by a task, without an exec)" in said, said
    assert not list((project.root / ".conveyor/runs").glob("*.session"))  # what named its session went with it


HELD_FLOW = """
import subprocess, sys
from prefect import flow
import conveyor

@flow
def mine():
    conveyor.run_stages("configs/pipeline.yaml", force=True)

mine()
"""


def test_what_a_killed_flow_runs_tasks_left_running_ends_with_the_next_command(
        make_project: Callable[[], Project]) -> None:
    """A deployment's flow run killed (a cancellation's SIGKILL, the OOM killer) inside
    conveyor.run_stages: what its tasks started ends with the next command in the project, and what
    they forked too where the flow run leads a session of its own (as Prefect's workspace starter
    starts it)."""
    project = _project(make_project, HOLDING, HOLD)
    flow_run = subprocess.Popen([sys.executable, "-c", HELD_FLOW], cwd=project.root, env=project.env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _ended_by_the_next_command(project, _killed_while_holding(project, flow_run, lambda: flow_run.pid))
