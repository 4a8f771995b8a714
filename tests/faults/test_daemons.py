"""Commands that daemonize: a process that leaves the command's process group (``setsid``, a
double fork, as ``mlflow server &`` or ``tensorboard &`` do) still ends with the stage, here and
on a Dask worker, whether the command succeeds, times out or its runner is killed (Linux: the
guard is a child subreaper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from distributed import Client, LocalCluster
from subprocs import marked, wait_until_none

from conveyor.run.commands import Command, CommandTimeout, run_here, run_on_worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")

# a daemon as servers make themselves: fork, setsid, fork again, parent and middle exit at once;
# it writes its pid (the command waits on the file, so the daemon is up when the command ends)
DAEMON = textwrap.dedent("""
    import os, sys, time
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
""")

START = (f"{sys.executable} daemon.py {{name}} </dev/null >/dev/null 2>&1; "
         "setsid sleep 300 </dev/null >/dev/null 2>&1 & "
         "while [ ! -s {name} ]; do sleep 0.02; done; echo up")


def _command(tmp_path: Path, *, then: str = "", timeout_s: float | None = None) -> Command:
    (tmp_path / "daemon.py").write_text(DAEMON)
    return Command("serve", (START.format(name="daemon.pid") + then,), cwd=str(tmp_path),
                   env={"CONVEYOR_TEST_MARK": uuid.uuid4().hex}, timeout_s=timeout_s)


def _escaped(tmp_path: Path, runner: int) -> bool:
    """The daemon left the guard's session (no kill of the guard's group reaches it)."""
    guard = psutil.Process(runner).children()[0]
    return os.getsid(int((tmp_path / "daemon.pid").read_text())) != os.getsid(guard.pid)


class Lines(list[tuple[str, str]]):
    def __call__(self, stream: str, line: str) -> None:
        self.append((stream, line))


def test_daemons_a_finished_command_left_are_stopped_and_named(tmp_path: Path) -> None:
    cmd = _command(tmp_path)
    lines = Lines()
    assert run_here(cmd, lines).returncode == 0
    assert ("out", "up") in lines
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []
    said = [line for stream, line in lines if stream == "err" and "left running" in line]
    assert said and "2 process(es)" in said[0] and "daemon.py" in said[0] and "sleep 300" in said[0], lines


def test_daemons_of_a_command_that_times_out_are_killed(tmp_path: Path) -> None:
    cmd = _command(tmp_path, then="; sleep 300", timeout_s=3)
    with pytest.raises(CommandTimeout):
        run_here(cmd, Lines())
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


RUNNER = textwrap.dedent("""
    import sys
    from conveyor.run.commands import Command, run_here
    cmd = Command("serve", (sys.argv[1] + "; sleep 300",), cwd=".", env={"CONVEYOR_TEST_MARK": sys.argv[2]})
    run_here(cmd, lambda stream, line: print(line, flush=True))
""")


def test_daemons_end_with_a_runner_killed_by_sigkill(tmp_path: Path) -> None:
    (tmp_path / "daemon.py").write_text(DAEMON)
    tag = uuid.uuid4().hex
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, START.format(name="daemon.pid"), tag],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        assert runner.stdout.readline().strip() == "up"
        assert _escaped(tmp_path, runner.pid)
    finally:
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
    assert wait_until_none(tag) == []


@pytest.fixture(scope="module")
def worker_client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster, set_as_default=False) as client:
        yield client


@pytest.mark.slow
def test_daemons_of_a_command_on_a_worker_end_with_it(worker_client: Client, tmp_path: Path) -> None:
    cmd = _command(tmp_path)
    assert run_on_worker(worker_client, cmd, Lines()).returncode == 0
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []
    timed = _command(tmp_path, then="; sleep 300", timeout_s=3)
    with pytest.raises(CommandTimeout):
        run_on_worker(worker_client, timed, Lines())
    assert wait_until_none(timed.env["CONVEYOR_TEST_MARK"]) == []
    assert marked(cmd.env["CONVEYOR_TEST_MARK"]) == []


@pytest.mark.parametrize("children_listed", [True, False], ids=["proc-children", "proc-scan"])
def test_descendants_are_found_by_either_walk_of_proc(monkeypatch: pytest.MonkeyPatch, children_listed: bool) -> None:
    """Linux without CONFIG_PROC_CHILDREN has no children files: the scan of every parent link stands in."""
    from conveyor.run import guard

    monkeypatch.setattr(guard, "_CHILDREN_LISTED", children_listed and guard._CHILDREN_LISTED)
    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & echo up; wait"], stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == "up"
        sleeping = [p.pid for p in psutil.Process(shell.pid).children()]
        assert guard.descendants(os.getpid()).count(shell.pid) == 1
        assert set(guard.descendants(shell.pid)) == set(sleeping) and sleeping
    finally:
        guard.signal_all([shell.pid, *guard.descendants(shell.pid)], signal.SIGKILL)
        shell.wait()
