"""Ctrl-C, SIGTERM and kill -9 of a run whose stages cannot be interrupted from Python.

Stage ``a`` is a task blocked in one C call (``time.sleep``), ``b`` a command; both write
their outs in place before they block, after ``c`` succeeded. Ctrl-C is sent as a terminal
sends it: the ^C character on a pseudo-terminal, which signals the whole foreground
process group. After each: the previous outs are in place, no process of the run is left,
the run record says what happened, and the next run does not redo what succeeded.
"""

from __future__ import annotations

import ctypes
import json
import os
import pty
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from prefect_homes import new_home
from projects import Project

pytestmark = pytest.mark.slow

SPEC = """
    pipeline: stuck
    stages:
      c:
        cmd: echo c > data/c.txt
        outs: [data/c.txt]
      a:
        task: tasks.stuck:block
        deps: [data/c.txt]
        outs: [data/a.txt]
      b:
        cmd: echo new > data/b.txt && touch b.started && sleep 600
        deps: [data/c.txt]
        outs: [data/b.txt]
"""

TASK = """
    import time
    from pathlib import Path


    def block(ctx):
        (ctx.root / "data/a.txt").write_text("new")  # in place, as a script would
        quick = (ctx.root / "quick").exists()
        (ctx.root / "a.started").touch()
        if not quick:
            time.sleep(600)  # one C call: no Python-level exception lands in it
"""


def stuck_project(make_project: Callable[[], Project], server: str,
                  prefect_home: Callable[[], Path]) -> Project:
    project = make_project()
    if server == "temporary":  # no PREFECT_API_URL: the run starts (and must end) its own server
        project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
        project.env["PREFECT_HOME"] = str(prefect_home())
    project.write("configs/pipeline.yaml", SPEC)
    project.write("tasks/__init__.py", "")
    project.write("tasks/stuck.py", TASK)
    for name in ("a", "b"):
        project.write(f"data/{name}.txt", "old")
    return project


@pytest.fixture
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    return lambda: new_home(tmp_path_factory.mktemp("prefect-home"))


def wait_both_started(project: Project, alive: Callable[[], bool], deadline_s: float = 240) -> None:
    deadline = time.monotonic() + deadline_s
    while not ((project.root / "a.started").exists() and (project.root / "b.started").exists()):
        assert alive(), "the run ended before both stages started"
        assert time.monotonic() < deadline, "the stages never started"
        time.sleep(0.1)


def in_terminal(project: Project, *args: str) -> tuple[int, int]:
    """``conveyor ARGS`` on a pseudo-terminal, as a user's shell starts it: (pid, terminal fd)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own whose controlling terminal is the pty
        try:
            os.chdir(project.root)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe("conveyor", ["conveyor", *args], project.env)
        finally:
            os._exit(127)
    return pid, fd


def read_until_exit(pid: int, fd: int, timeout_s: float) -> tuple[int, str, float]:
    """Everything the terminal shows until ``pid`` exits: (exit code, text, seconds it took)."""
    t0, chunks = time.monotonic(), []
    while time.monotonic() - t0 < timeout_s:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace"), time.monotonic() - t0


def assert_nothing_lost(project: Project) -> None:
    assert (project.root / "data/a.txt").read_text() == "old"
    assert (project.root / "data/b.txt").read_text() == "old"
    assert not project.left_running(grace_s=10), "a process outlived the interrupted run"


@pytest.mark.parametrize("server", ["configured", "temporary"])
def test_ctrl_c_in_a_terminal_stops_stages_blocked_in_c_calls_at_once(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path], server: str) -> None:
    project = stuck_project(make_project, server, prefect_home)
    pid, fd = in_terminal(project, "run")
    wait_both_started(project, lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    os.write(fd, b"\x03")  # what the terminal sends on Ctrl-C: SIGINT to the foreground group
    code, screen, took = read_until_exit(pid, fd, timeout_s=60)
    assert code == 130, screen[-3000:]
    assert took < 20, f"Ctrl-C took {took:.0f}s to stop the run"
    assert "interrupted (SIGINT): stopped a, b (previous outs kept)" in screen, screen[-3000:]
    assert "Traceback" not in screen, screen
    assert_nothing_lost(project)
    record = project.record()
    assert record["status"] == "interrupted"
    assert {name: st["status"] for name, st in record["stages"].items()} == {
        "c": "succeeded", "a": "interrupted", "b": "interrupted"}
    assert "cannot be interrupted" in record["stages"]["a"]["error"]


def test_a_closed_terminal_stops_the_run_as_ctrl_c_does_and_exits_129(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path]) -> None:
    """The terminal window closed mid-run: SIGHUP to conveyor, and every write to the terminal
    fails from then on. The previous outs are back at once (not when some later command runs),
    the record says interrupted, nothing is left running."""
    project = stuck_project(make_project, "temporary", prefect_home)
    pid, fd = in_terminal(project, "run")
    wait_both_started(project, lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    os.close(fd)  # the terminal is gone: the kernel hangs up its session
    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        assert time.monotonic() < deadline, "the run did not stop when its terminal closed"
        time.sleep(0.1)
    assert os.waitstatus_to_exitcode(waited[1]) == 129
    assert_nothing_lost(project)  # before any other conveyor command looked at the project
    assert not list((project.root / ".conveyor/journal").iterdir())
    record = project.record()
    assert record["status"] == "interrupted"
    assert {name: st["status"] for name, st in record["stages"].items()} == {
        "c": "succeeded", "a": "interrupted", "b": "interrupted"}


def test_ctrl_c_while_the_temporary_server_starts_records_the_run_interrupted(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path]) -> None:
    project = stuck_project(make_project, "temporary", prefect_home)
    pid, fd = in_terminal(project, "run")
    deadline = time.monotonic() + 120
    while not [c for c in psutil.Process(pid).children(recursive=True) if "uvicorn" in " ".join(c.cmdline())]:
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the run ended before its server started"
        assert time.monotonic() < deadline, "the temporary Prefect server never started"
        time.sleep(0.02)
    assert not list((project.root / ".conveyor/logs").glob("*/run.log")), "the flow had begun: too late"
    os.write(fd, b"\x03")
    code, screen, _ = read_until_exit(pid, fd, timeout_s=60)
    assert code == 130, screen[-3000:]
    assert "interrupted (SIGINT): no stage was running" in screen, screen[-3000:]
    assert "Traceback" not in screen, screen
    assert_nothing_lost(project)
    record = project.record()
    assert record["status"] == "interrupted", record
    assert {st["status"] for st in record["stages"].values()} == {"not_run"}
    assert {st["reason"] for st in record["stages"].values()} == {"the run was interrupted before it started"}


@pytest.mark.parametrize("server", ["configured", "temporary"])
def test_sigterm_stops_the_run_and_exits_143(make_project: Callable[[], Project],
                                              prefect_home: Callable[[], Path], server: str) -> None:
    project = stuck_project(make_project, server, prefect_home)
    proc = project.popen("run")
    wait_both_started(project, lambda: proc.poll() is None)
    t0 = time.monotonic()
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - t0 < 20
    assert "interrupted (SIGTERM): stopped a, b" in out and "Traceback" not in out
    assert_nothing_lost(project)
    assert project.record()["status"] == "interrupted"


def test_an_interrupted_forced_run_says_to_resume_what_it_had_not_finished_forced(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path]) -> None:
    """After `run --force`, plain `conveyor run` would skip stages that were up to date before it:
    the resume line names those it had not finished, alone and forced."""
    project = stuck_project(make_project, "configured", prefect_home)
    proc = project.popen("run", "--force")
    wait_both_started(project, lambda: proc.poll() is None)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "resume with: conveyor run a b -s --force\n" in out, out[-3000:]
    assert_nothing_lost(project)


def _signalled_thread(pid: int) -> int:
    """A thread of ``pid`` other than its main one that does not block SIGINT."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        tid = int(task.name)
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        if tid != pid and not int(status["SigBlk"], 16) & (1 << (signal.SIGINT - 1)):
            return tid
    raise AssertionError(f"no thread of {pid} but the main one takes SIGINT")


def test_sigint_delivered_to_another_thread_than_the_main_one_still_stops_the_run(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path]) -> None:
    """The kernel hands a signal sent to a process to any of its threads; Python runs the handler
    in the main thread, which must not sleep through it (it waits for stages that never end)."""
    project = stuck_project(make_project, "configured", prefect_home)
    proc = project.popen("run")
    wait_both_started(project, lambda: proc.poll() is None)
    t0 = time.monotonic()
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    run = project.run_pid(proc)
    assert tgkill(run, _signalled_thread(run), signal.SIGINT) == 0, os.strerror(ctypes.get_errno())
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert time.monotonic() - t0 < 20
    assert "interrupted (SIGINT): stopped a, b" in out and "Traceback" not in out
    assert_nothing_lost(project)


def test_a_killed_run_is_recorded_interrupted_by_the_next_command_which_reruns_only_what_did_not_finish(
        make_project: Callable[[], Project], prefect_home: Callable[[], Path]) -> None:
    project = stuck_project(make_project, "temporary", prefect_home)
    proc = project.popen("run")
    wait_both_started(project, lambda: proc.poll() is None)
    run_id = project.record()["run_id"]
    proc.kill()
    proc.communicate(timeout=30)
    assert not project.left_running(grace_s=5), "a process outlived the killed run"

    status = project.conveyor("status")
    assert status.returncode == 0, status.stderr
    assert "put back the previous outs of 'a'" in status.stderr
    assert f"the last run ({run_id}) was killed while a, b ran: recorded as interrupted" in status.stderr
    assert (project.root / "data/a.txt").read_text() == "old"
    assert (project.root / "data/b.txt").read_text() == "old"
    killed = json.loads((project.root / f".conveyor/runs/{run_id}.json").read_text())
    assert killed["status"] == "interrupted"
    assert {name: st["status"] for name, st in killed["stages"].items()} == {
        "c": "succeeded", "a": "interrupted", "b": "interrupted"}
    assert not (project.root / f".conveyor/runs/{run_id}.events").exists()

    (project.root / "quick").touch()
    project.write("configs/pipeline.yaml", SPEC.replace("&& sleep 600", ""))  # b's command changed: it reruns
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    stages = project.record()["stages"]
    assert {name: st["status"] for name, st in stages.items()} == {
        "c": "skipped", "a": "succeeded", "b": "succeeded"}
