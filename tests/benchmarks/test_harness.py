"""The benchmarks' harness: hyperfine times real commands, psutil sees their whole process tree,
and what a command leaves running is found and ended (real processes, no mocks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.commands import alternating, timed
from benchmarks.harness import CheckFailed, Config
from benchmarks.processes import leftovers

needs_hyperfine = pytest.mark.skipif(shutil.which("hyperfine") is None,
                                     reason="hyperfine is not installed (apt-get install hyperfine)")

# a child that starts a grandchild holding 200 MiB for a moment: only a tree-wide sampler sees it
GRANDCHILD_HOLDS_200_MIB = (
    "import subprocess, sys; subprocess.run([sys.executable, '-c', "
    "\"import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.6)\"], check=True)"
)


@needs_hyperfine
def test_timed_gives_the_commands_wall_and_stdout(tmp_path: Path) -> None:
    done = timed([sys.executable, "-c", "import time; time.sleep(0.3); print('slept')"], tmp_path, os.environ)

    assert 0.3 <= done.seconds < 5
    assert done.stdout == "slept\n"
    assert not done.left


@needs_hyperfine
def test_timed_samples_the_memory_of_the_whole_process_tree(tmp_path: Path) -> None:
    done = timed([sys.executable, "-c", GRANDCHILD_HOLDS_200_MIB], tmp_path, os.environ, memory=True)

    assert done.peak_mib >= 200


@needs_hyperfine
def test_a_failing_command_is_a_failed_check_with_its_output(tmp_path: Path) -> None:
    with pytest.raises(CheckFailed, match=r"exited 3:\nhalf done"):
        timed([sys.executable, "-c", "import sys; print('half done'); sys.exit(3)"], tmp_path, os.environ)


@needs_hyperfine
@pytest.mark.slow
def test_what_outlives_the_command_is_killed_and_reported(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (f"import subprocess, pathlib; p = subprocess.Popen(['sleep', '300']); "
              f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))")

    with pytest.raises(CheckFailed, match="still running 10 s after it exited"):
        timed([sys.executable, "-c", script], tmp_path, os.environ)

    stray = int(pid_file.read_text())
    _gone, alive = psutil.wait_procs([psutil.Process(stray)], timeout=5) if psutil.pid_exists(stray) else ([], [])
    assert not alive


@needs_hyperfine
def test_alternating_runs_each_side_once_a_repetition(tmp_path: Path) -> None:
    base, cand = alternating([sys.executable, "-c", "pass"],
                             [sys.executable, "-c", "import time; time.sleep(1.5)"], tmp_path, os.environ, 3)

    assert len(base) == len(cand) == 3
    assert all(c > b for b, c in zip(base, cand, strict=True))


def test_leftovers_finds_and_ends_processes_of_a_prefect_home(tmp_path: Path) -> None:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path)}
    stray = subprocess.Popen(["sleep", "300"], env=env)
    try:
        assert leftovers(tmp_path, grace_s=0.2) == [stray.pid]
        assert stray.wait(timeout=5) == -9
    finally:
        stray.kill()
        stray.wait()


def test_the_example_get_started_benchmark_names_the_clone_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.dvc import example_get_started

    monkeypatch.delenv(example_get_started.SOURCE, raising=False)
    with pytest.raises(CheckFailed, match=f"set {example_get_started.SOURCE} to a clone of iterative/example-get"):
        example_get_started.run(Config(quick=True), lambda line: None)
