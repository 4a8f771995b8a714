"""cmd stages' commands: real /bin/sh processes, here and on a real Dask worker; none outlives its run."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client, LocalCluster
from subprocs import marked, wait_until_none

from conveyor.run.commands import Command, CommandTimeout, Finished, _exit_notice, run_here, run_on_worker
from conveyor.run.tree_memory import CommandOverMemory


def command(tmp_path: Path, *commands: str, timeout_s: float | None = None, **env: str) -> Command:
    tag = uuid.uuid4().hex
    return Command("stage", commands, cwd=str(tmp_path), env={"CONVEYOR_TEST_MARK": tag, **env},
                   timeout_s=timeout_s)


class Lines:
    """A sink that keeps what a command wrote."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, stream: str, line: str) -> None:
        with self.lock:
            self.lines.append((stream, line))

    def of(self, stream: str) -> list[str]:
        return [line for s, line in self.lines if s == stream]


def test_a_command_runs_in_its_directory_and_its_lines_are_streamed(tmp_path: Path) -> None:
    lines = Lines()
    cmd = command(tmp_path, "pwd; echo one; echo two >&2; printf 'no newline'")
    assert run_here(cmd, lines) == Finished(0, ("two",))
    assert lines.of("out") == [str(tmp_path), "one", "no newline"]
    assert lines.of("err") == ["two"]


def test_a_failing_command_reports_its_status_and_the_tail_of_stderr(tmp_path: Path) -> None:
    lines = Lines()
    cmd = command(tmp_path, "for i in $(seq 1 30); do echo err$i >&2; done; exit 3")
    finished = run_here(cmd, lines)
    assert finished.returncode == 3
    assert finished.stderr_tail == tuple(f"err{i}" for i in range(11, 31))  # the last 20 lines


def test_a_list_of_commands_runs_in_order_and_stops_at_the_first_failure(tmp_path: Path) -> None:
    lines = Lines()
    cmd = command(tmp_path, "echo first", "cd /; echo second; false", "echo third")
    assert run_here(cmd, lines).returncode == 1
    assert lines.of("out") == ["first", "second"]


def test_a_command_killed_by_a_signal_says_so(tmp_path: Path) -> None:
    assert run_here(command(tmp_path, "kill -9 $$"), Lines()).returncode == 128 + 9


def test_a_command_starts_as_from_a_shell_stdin_empty_sigpipe_default_only_its_own_descriptors(
        tmp_path: Path) -> None:
    """The guard (started without json or subprocess) starts each command as ``subprocess.call``
    did: standard input from /dev/null, SIGPIPE and SIGXFSZ not ignored (Python ignores SIGPIPE:
    inherited, ``yes | head`` would print "Broken pipe"), nothing else ignored that this process
    does not (glibc's posix_spawn leaves its internal signals 32 and 33 ignored), no descriptor
    but 0-2, the shell found on PATH, each command one argument however it is quoted."""
    lines = Lines()
    cmd = command(tmp_path, "readlink /proc/self/fd/0; grep SigIgn /proc/self/status; ls /proc/self/fd",
                  "yes | head -n 1", "echo \"it's\" '\"quoted\"' $((1 + 1))")
    cmd = Command(cmd.stage, cmd.commands, cmd.cwd, cmd.env, shell=("sh", "-c"))
    assert run_here(cmd, lines) == Finished(0, ())
    out = lines.of("out")
    assert out[0] == "/dev/null"
    with open("/proc/self/status") as f:
        ours = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    assert int(out[1].split()[1], 16) == ours & ~(1 << (signal.SIGPIPE - 1)) & ~(1 << (signal.SIGXFSZ - 1))
    assert out[2:-2] == ["0", "1", "2", "3"]  # 3: the listing's own
    assert out[-2:] == ["y", "it's \"quoted\" 2"]
    assert lines.of("err") == []


def test_a_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    cmd = command(tmp_path, "sleep 300 & sleep 300; echo never", timeout_s=1)
    start = time.monotonic()
    with pytest.raises(CommandTimeout, match=r"^stage 'stage' failed: timed out after 1s \(timeout_s\)"):
        run_here(cmd, Lines())
    assert time.monotonic() - start < 8
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    cmd = command(tmp_path, "trap '' TERM; sleep 300 & wait", timeout_s=0.5)
    with pytest.raises(CommandTimeout):
        run_here(cmd, Lines())
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


def test_background_processes_of_a_finished_command_do_not_outlive_it(tmp_path: Path) -> None:
    cmd = command(tmp_path, "(sleep 300 &); nohup sleep 300 >/dev/null 2>&1 & echo started")
    assert run_here(cmd, Lines()).returncode == 0
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


def interrupt_when_started(cmd: Command, lines: Lines, *, ready: threading.Event | None = None) -> list[str]:
    """Run ``cmd`` in a stage thread and raise KeyboardInterrupt in that thread (StageRunner.interrupt:
    Ctrl-C) once the command has printed ``started`` (and ``ready`` is set): what the thread caught."""
    import ctypes

    caught: list[str] = []

    def stage() -> None:
        try:
            run_here(cmd, lines)
        except KeyboardInterrupt:
            caught.append("interrupted")

    thread = threading.Thread(target=stage)
    thread.start()
    assert ready is None or ready.wait(30)
    while lines.of("out") != ["started"]:
        time.sleep(0.02)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(KeyboardInterrupt))
    thread.join(10)
    return caught


def test_an_interrupt_of_the_waiting_thread_kills_the_command(tmp_path: Path) -> None:
    """Ctrl-C reaches a stage as KeyboardInterrupt raised in its thread (StageRunner.interrupt)."""
    cmd = command(tmp_path, "echo started; sleep 300")
    assert interrupt_when_started(cmd, Lines()) == ["interrupted"]
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


def test_an_interrupt_while_the_output_readers_start_kills_the_command_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C just after the command started, while its second reader thread starts (a thread's start
    waits for it: long on a loaded machine): its processes end all the same (they ran on, once)."""
    from conveyor.run import commands

    reader, starting = commands._reader, threading.Event()

    def slow_to_start(stream: Any, name: str, sink: Any, tail: Any) -> threading.Thread:
        thread = reader(stream, name, sink, tail)
        if name == "err":  # the interrupt comes in here
            starting.set()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.01)
        return thread

    monkeypatch.setattr(commands, "_reader", slow_to_start)
    cmd = command(tmp_path, "echo started; sleep 300")
    assert interrupt_when_started(cmd, Lines(), ready=starting) == ["interrupted"]
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here (Linux 5.3+)")
def test_a_waiting_stage_wakes_when_its_command_exits_not_at_the_end_of_its_step() -> None:
    """A chain's next stage starts when the command before it ends (``Popen.wait`` with a
    timeout noticed it up to 50 ms late)."""
    process = subprocess.Popen(["sleep", "0.1"])
    with _exit_notice(process.pid) as step:
        started = time.monotonic()
        timeout = step(60)
        waited = time.monotonic() - started
    assert process.poll() is not None and timeout == 0.0  # it had exited when the step returned
    assert waited < 30  # long before the 60 s step ended


def test_a_command_is_waited_for_with_over_a_thousand_descriptors_open(tmp_path: Path) -> None:
    """A long run holds many descriptors (Dask's sockets, open files): its pidfds pass 1024, which
    ``select.select`` refuses."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"at most {hard} descriptors here")
    if soft != resource.RLIM_INFINITY and soft < 4096:  # room for the 1,030 beside what this process holds
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        assert max(held) >= 1024
        assert run_here(command(tmp_path, "exit 4"), Lines()).returncode == 4
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_without_pidfds_a_command_is_waited_for_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")  # an old kernel, or a sandbox that refuses it

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    lines = Lines()
    assert run_here(command(tmp_path, "echo done; exit 3"), lines).returncode == 3
    assert lines.of("out") == ["done"]


RUNNER = textwrap.dedent("""
    import sys
    from conveyor.run.commands import Command, run_here
    cmd = Command("stage", ("sleep 300 & echo started; sleep 300",), cwd=".", env={"CONVEYOR_TEST_MARK": sys.argv[1]})
    run_here(cmd, lambda stream, line: print(line, flush=True))
""")


def test_a_command_dies_with_a_runner_killed_by_sigkill(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, tag], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    assert runner.stdout is not None
    assert runner.stdout.readline().strip() == "started"
    assert len(marked(tag)) >= 3  # the guard, sh and two sleeps
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait()
    assert wait_until_none(tag) == []


# --------------------------------------------------------------------------- on a Dask worker


@pytest.fixture(scope="module")
def worker_client() -> Iterator[Client]:
    """One worker process, as a dask-cuda worker would be (it sees GPUs 2 and 3, its own first)."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", env={"CUDA_VISIBLE_DEVICES": "2,3"}) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield client


@pytest.mark.slow
def test_a_command_on_a_worker_sends_its_lines_back(worker_client: Client, tmp_path: Path) -> None:
    lines = Lines()
    cmd = command(tmp_path, "echo on-worker; echo $CUDA_VISIBLE_DEVICES; for i in 1 2 3; do echo $i; done; exit 4")
    finished = run_on_worker(worker_client, cmd, lines)
    assert finished.returncode == 4
    assert lines.of("out") == ["on-worker", "2,3", "1", "2", "3"]
    worker_pids = set(worker_client.run(os.getpid).values())
    assert os.getpid() not in worker_pids


@pytest.mark.slow
def test_a_command_on_a_gpu_worker_sees_only_its_own_gpu(worker_client: Client, tmp_path: Path) -> None:
    lines = Lines()
    cmd = command(tmp_path, "echo $CUDA_VISIBLE_DEVICES")
    cmd = Command(cmd.stage, cmd.commands, cmd.cwd, cmd.env, own_gpu=True)
    assert run_on_worker(worker_client, cmd, lines).returncode == 0
    assert lines.of("out") == ["2"]


@pytest.mark.slow
def test_a_timeout_on_a_worker_kills_the_command_there(worker_client: Client, tmp_path: Path) -> None:
    cmd = command(tmp_path, "sleep 300 & sleep 300", timeout_s=1)
    with pytest.raises(CommandTimeout):
        run_on_worker(worker_client, cmd, Lines())
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []


@pytest.mark.slow
def test_an_interrupted_stage_kills_its_command_on_the_worker(worker_client: Client, tmp_path: Path) -> None:
    import ctypes

    cmd = command(tmp_path, "echo started; sleep 300")
    lines, caught = Lines(), []

    def stage() -> None:
        try:
            run_on_worker(worker_client, cmd, lines)
        except KeyboardInterrupt:
            caught.append("interrupted")

    thread = threading.Thread(target=stage)
    thread.start()
    deadline = time.monotonic() + 30
    while lines.of("out") != ["started"] and time.monotonic() < deadline:
        time.sleep(0.02)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(KeyboardInterrupt))
    thread.join(30)
    assert caught == ["interrupted"]
    assert wait_until_none(cmd.env["CONVEYOR_TEST_MARK"]) == []
    assert worker_client.submit(lambda: 1, pure=False).result(timeout=30) == 1  # the worker is free again


@pytest.mark.slow
def test_a_command_past_its_workers_memory_limit_is_killed(tmp_path: Path) -> None:
    """The nanny measures only the worker's own process; the command's tree is measured beside it."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", memory_limit="200MiB",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster, set_as_default=False) as client:
        hog = command(tmp_path, f'{sys.executable} -c "b = bytearray(2_000_000_000); import time; time.sleep(30)" &'
                                " wait")  # in a grandchild of the guard: the whole tree counts
        t0 = time.monotonic()
        with pytest.raises(CommandOverMemory) as caught:
            run_on_worker(client, hog, Lines())
        assert time.monotonic() - t0 < 20  # not its 30 s of sleep
        assert caught.value.limit == 200 * 2**20 and caught.value.fraction == 0.95
        assert caught.value.used > 0.95 * 200 * 2**20
        assert wait_until_none(hog.env["CONVEYOR_TEST_MARK"]) == []
        modest = command(tmp_path, f'{sys.executable} -c "b = bytearray(20_000_000)"')
        assert run_on_worker(client, modest, Lines()).returncode == 0
