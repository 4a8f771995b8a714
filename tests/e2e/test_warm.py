"""The warm runner (conveyor.cli.warm): a run is forked from a process that has imported Prefect
and DVC (the first run of an environment starts it and waits for it), and behaves as a fresh
process would: its output, exit code, working directory and environment are the command's own;
Ctrl-C and kill reach it; kill -9 of the command kills it; the runner is listed, stopped on demand
and after its idle time, and a changed environment gets a runner of its own."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import py_compile
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from projects import Project
from subprocs import is_warm_runner

HOLD = "touch started && while [ ! -e release ]; do sleep 0.05; done && echo done > held.txt"


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A PREFECT_HOME of the test's own: its warm runners are the test's; killed at the end."""
    home = tmp_path_factory.mktemp("warm-home")
    yield home
    for proc in runners(home):
        proc.kill()


def kept_under(project: Project, home: Path, idle: str = "120") -> Project:
    """``project``, its runs using warm runners kept under ``home`` (not the suite's own settings)."""
    project.env.update(PREFECT_HOME=str(home), CONVEYOR_SERVER_IDLE=idle)
    for name in ("CONVEYOR_WARM", "CONVEYOR_WARM_IDLE"):  # the suite's own settings (tests/conftest.py)
        project.env.pop(name, None)
    return project


def task_project(make_project: Callable[[], Project], home: Path, task: str, out: str) -> Project:
    """A project of one task stage, ``use`` (``tasks/use.py``: ``task``) writing ``out``, kept under ``home``."""
    project = kept_under(make_project(), home)
    project.write("configs/pipeline.yaml", f"pipeline: one\nstages:\n  use: {{task: tasks.use:use, outs: [{out}]}}\n")
    project.write("tasks/__init__.py", "")
    project.write("tasks/use.py", task)
    return project


def warm_project(make_project: Callable[[], Project], home: Path, idle: str = "120") -> Project:
    """A project whose runs use warm runners kept under ``home`` (the session's Prefect server)."""
    project = kept_under(make_project(), home, idle)
    project.init_dvc()
    project.write("ancestry.py", ANCESTRY)
    project.write("dvc.yaml", """
        stages:
          one:
            cmd: python ancestry.py > one.txt && echo said-one
            outs: [one.txt]
    """)
    return project


def hold_project(make_project: Callable[[], Project], home: Path) -> Project:
    """:func:`warm_project` once run (its runner serves), its one stage now ``hold``: it waits for ``release``."""
    project = warm_project(make_project, home)
    assert project.conveyor("run").returncode == 0
    ready(home)
    project.write("dvc.yaml", f"""
        stages:
          hold: {{cmd: '{HOLD}', outs: [held.txt]}}
    """)
    return project


# The stage's processes up to init (pid, command line), and the COLUMNS it was given.
ANCESTRY = """
import json, os
chain, pid = [], os.getpid()
while pid > 1:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        line = f.read().replace(b"\\0", b" ").decode()
    with open(f"/proc/{pid}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    chain.append([pid, line])
    pid = parent
print(json.dumps({"chain": chain, "columns": os.environ.get("COLUMNS")}))
"""


def runners(home: Path) -> list[psutil.Process]:
    """The warm runners of ``home`` (not the runs they forked: those share their command line)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if is_warm_runner(proc) and proc.environ().get("PREFECT_HOME") == str(home) \
                    and proc.status() != psutil.STATUS_ZOMBIE and not is_warm_runner(proc.parent()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def ready(home: Path, count: int = 1, deadline_s: float = 60) -> list[dict[str, float]]:
    """Wait until ``count`` runners of ``home`` serve (their state files say so once they listen)."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = []
        for path in sorted((home / "conveyor-server/warm").glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                states.append(json.loads(path.read_text()))
        if len([s for s in states if s["served"] >= 0]) >= count:
            return states
        assert time.monotonic() < deadline, f"{len(states)} warm runner(s) ready, wanted {count}"
        time.sleep(0.05)


def served(home: Path) -> int:
    """The runs the one runner of ``home`` has served (its state file says)."""
    count: int = json.loads(next((home / "conveyor-server/warm").glob("*.json")).read_text())["served"]
    return count


def learned(home: Path) -> list[str]:
    """The libraries the one runner of ``home`` has imported for its runs (its state file says)."""
    names: list[str] = json.loads(next((home / "conveyor-server/warm").glob("*.json")).read_text())["learned"]
    return names


def stage_ancestry(project: Project) -> dict[str, object]:
    """What stage ``one`` wrote: its processes up to init, and its COLUMNS."""
    data: dict[str, object] = json.loads((project.root / "one.txt").read_text())
    return data


def forked_by(project: Project) -> list[int]:
    """The warm runners stage ``one`` ran under (the pids of its ancestors that are runners' processes)."""
    chain = stage_ancestry(project)["chain"]
    assert isinstance(chain, list)
    return [pid for pid, line in chain if "conveyor.cli.warm_runner" in line]


def wait_gone(procs: list[psutil.Process], what: str, deadline_s: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=deadline_s)
    assert not alive, f"{what} still running: {alive}"


def test_runs_are_forked_by_the_warm_runner_the_first_started_and_are_the_command_itself(
        make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stderr
    [state] = ready(home)
    [runner] = runners(home)
    assert runner.pid == state["pid"] and state["served"] == 1
    assert runner.pid in forked_by(project)  # the first run too: the runner it started forked it
    # it imports without what it may differ in: the terminal's COLUMNS, the CONVEYOR_WARM_IGNORE'd tag
    assert not {"COLUMNS", "CONVEYOR_TEST_TAG"} & set(runner.environ())

    again = project.conveyor("run", "-f", "-v", env={"COLUMNS": "123"})  # a volatile variable: the same runner
    assert again.returncode == 0, again.stderr
    assert "said-one" in again.stdout + again.stderr  # the command's output is the command's
    assert "succeeded" in again.stdout + again.stderr
    assert runner.pid in forked_by(project)  # forked by the runner, not started afresh
    assert stage_ancestry(project)["columns"] == "123"  # the command's environment
    assert json.loads((project.root / ".conveyor/runs/latest.json").read_text())["status"] == "succeeded"
    assert project.sh("dvc", "status").stdout.strip() == "Data and pipelines are up to date."

    other = warm_project(make_project, home)  # another project, the same environment: the same runner
    other.env = {**project.env, "CONVEYOR_TEST_TAG": project.env["CONVEYOR_TEST_TAG"]}
    done = other.conveyor("run")
    assert done.returncode == 0, done.stderr
    assert runner.pid in forked_by(other)

    listed = project.conveyor("server", "status")
    assert f"warm runners:  1 (pid {runner.pid}" in listed.stdout, listed.stdout

    # a runner that is up serves the short commands too; where none serves, they start none
    before = served(home)
    status = project.conveyor("status", "--exit-code")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr
    invalid = project.conveyor("validate", "-c", "configs/nope.yaml")
    assert invalid.returncode == 2 and "configs/nope.yaml" in invalid.stderr, invalid.stderr
    assert served(home) == before + 2
    elsewhere = project.conveyor("status", env={"CONVEYOR_SOME_SETTING": "x"})  # no runner of its own
    assert elsewhere.returncode == 0 and "up to date" in elsewhere.stdout, elsewhere.stderr
    assert runners(home) == [runner]


@pytest.mark.slow
def test_exit_codes_and_errors_are_the_commands_and_a_new_environment_gets_its_own_runner(
        make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    assert project.conveyor("run").returncode == 0
    ready(home)
    project.write("dvc.yaml", """
        stages:
          one: {cmd: echo broken >&2 && exit 7, outs: [one.txt]}
    """)
    failed = project.conveyor("run")
    assert failed.returncode == 1 and "one" in failed.stderr and "failed" in failed.stdout + failed.stderr
    assert (project.root / "one.txt").exists()  # the previous outs, intact
    bad = project.conveyor("run", "--no-such-option")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--no-such-option" in bad.stderr
    # a run killed by SIGKILL (the kernel's OOM killer) ends the command so, and is not run again
    # (the command took the child's end for a runner that took no command: twice forked, then here)
    killed = task_project(make_project, home, KILLS_ITSELF, "never.txt")
    done = killed.conveyor("run")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert (killed.root / "attempts.txt").read_text() == "attempt\n"
    [runner] = runners(home)

    changed = project.conveyor("run", env={"CONVEYOR_SOME_SETTING": "x"})  # another environment: a runner of its own
    assert changed.returncode == 1
    ready(home, 2)
    assert len(runners(home)) == 2 and runner in runners(home)

    stopped = project.conveyor("server", "stop")
    assert stopped.returncode == 0 and "stopping 2 warm runner(s)" in stopped.stdout, stopped.stdout
    wait_gone([runner], "a stopped runner")
    assert "warm runners:  none" in project.conveyor("server", "status").stdout


@pytest.mark.slow
def test_ctrl_c_reaches_the_run_and_kill_9_of_the_command_kills_it(
        make_project: Callable[[], Project], home: Path) -> None:
    project = hold_project(make_project, home)
    (project.root / "held.txt").write_text("previous\n")

    run = project.popen("run")
    _wait_for(project.root / "started", run)
    [runner] = runners(home)
    [child] = runner.children()
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=60)
    assert run.returncode == 130, output
    assert "interrupted (SIGINT)" in output
    wait_gone([child], "the interrupted run")
    assert (project.root / "held.txt").read_text() == "previous\n"  # the previous outs, back
    kept = {p.pid for p in runners(home)}  # kept on purpose: the runner only
    wait_gone([p for p in project.tagged_processes() if p.pid not in kept], "a process of the interrupted run")

    (project.root / "started").unlink()
    run = project.popen("run")
    _wait_for(project.root / "started", run)
    [child] = runner.children()
    stage = child.children(recursive=True)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=30)
    wait_gone([child, *stage], "the run of a killed command, or its stage")
    status = project.conveyor("status")  # what follows a killed run, as without a runner
    assert "put back the previous outs of 'hold'" in status.stderr, status.stderr
    assert "was killed while hold ran: recorded as interrupted" in status.stderr
    assert (project.root / "held.txt").read_text() == "previous\n"
    (project.root / "release").touch()
    again = project.conveyor("run")  # the next run goes on, in the same runner
    assert again.returncode == 0, again.stderr
    assert (project.root / "held.txt").read_text() == "done\n" and runner.is_running()


@pytest.mark.slow
def test_the_runner_ends_after_its_idle_time(make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home, idle="2")
    assert project.conveyor("run").returncode == 0
    ready(home)
    [runner] = runners(home)
    assert project.conveyor("run", "-f").returncode == 0
    old = home / "conveyor-server/warm/0123456789abcdef0123456789abcdef.log"  # as runners left them before
    old.touch()
    os.utime(old, (time.time() - 2 * 86_400,) * 2)
    wait_gone([runner], "a runner past its idle time", 30)
    assert not list((home / "conveyor-server/warm").glob("*.json"))
    assert not list((home / "conveyor-server/warm").glob("*.log"))  # it said nothing: its log goes too


@pytest.mark.slow
def test_a_runner_stopped_while_its_run_goes_on_leaves_the_files_of_the_runner_started_after_it(
        make_project: Callable[[], Project], home: Path) -> None:
    project = hold_project(make_project, home)
    [first] = runners(home)
    held = project.popen("run")
    _wait_for(project.root / "started", held)
    stopped = project.conveyor("server", "stop")  # it stops listening; it ends once the held run has
    assert "stopping 1 warm runner(s)" in stopped.stdout, stopped.stdout
    other = warm_project(make_project, home)  # the same environment: a runner of the same key, started now
    assert other.conveyor("run").returncode == 0
    [second] = [runner for runner in runners(home) if runner.pid != first.pid]
    (project.root / "release").touch()
    output, _ = held.communicate(timeout=60)
    assert held.returncode == 0, output
    wait_gone([first], "the stopped runner, once its run ended")
    listed = project.conveyor("server", "status").stdout  # the second runner's state file is still there
    assert "warm runners:  1 (pid " in listed and str(second.pid) in listed, listed
    assert "stopping 1 warm runner(s)" in project.conveyor("server", "stop").stdout
    wait_gone([second], "the second runner")
    assert not list((home / "conveyor-server/warm").glob("*"))


# A task whose process dies as the kernel's OOM killer ends one, once it has said so.
KILLS_ITSELF = """
import os
import signal


def use(ctx):
    with (ctx.root / "attempts.txt").open("a") as attempts:
        attempts.write("attempt\\n")
    os.kill(os.getpid(), signal.SIGKILL)
"""

# A task that says which data libraries its process had imported before it imported them, then
# uses what a fork could break in them: OpenBLAS's threads, pyarrow's allocator, dask's threads,
# GNU OpenMP's pool (XGBoost's and scikit-learn's, on two threads each).
LEARNING_TASK = """
import sys

BEFORE = [n for n in ("numpy", "pandas", "pyarrow", "dask.dataframe", "sklearn", "xgboost") if n in sys.modules]

import json

import dask.dataframe as dd
import numpy as np
import pandas as pd
import xgboost
from sklearn.ensemble import HistGradientBoostingRegressor


def use(ctx):
    a = np.random.default_rng(0).standard_normal((300, 300))
    pd.DataFrame({"x": np.arange(1000), "y": np.arange(1000) / 2}).to_parquet(ctx.root / "frame.parquet")
    frame = dd.read_parquet(ctx.root / "frame.parquet").map_partitions(lambda p: p.assign(z=p.x + p.y))
    x, y = a[:, :10], a[:, 10]
    boosted = xgboost.train({"nthread": 2, "seed": 0}, xgboost.DMatrix(x, label=y), num_boost_round=5)
    hist = HistGradientBoostingRegressor(max_iter=5, random_state=0).fit(x, y)
    done = {"before": BEFORE, "blas": float((a @ a.T).trace()), "z": float(frame.z.sum().compute(scheduler="threads")),
            "models": [float(boosted.predict(xgboost.DMatrix(x)).sum()), float(hist.predict(x).sum())],
            "unseeded": float(np.random.rand())}
    ctx.out().write_text(json.dumps(done))
"""


def test_a_runner_imports_the_data_libraries_its_runs_imported_before_it_forks_the_next(
        make_project: Callable[[], Project], home: Path) -> None:
    project = task_project(make_project, home, LEARNING_TASK, "used.json")
    runs = []
    for index in range(3):
        done = project.conveyor("run", "-f")
        assert done.returncode == 0, done.stdout + done.stderr
        runs.append(json.loads((project.root / "used.json").read_text()))
        if index == 0:  # a `status` is forked without them: only a run waits for them, once
            assert project.conveyor("status").returncode == 0
            assert learned(home) == []
    assert served(home) == 4  # all forked by the runner the first started
    first, second, third = runs
    assert first["before"] == []  # the first run imported them itself
    # the runner had imported them, once
    assert second["before"] == third["before"] == ["numpy", "pandas", "pyarrow", "dask.dataframe", "sklearn", "xgboost"]
    assert [(r["blas"], r["z"]) for r in (second, third)] == [(first["blas"], first["z"])] * 2
    assert second["models"] == third["models"] == pytest.approx(first["models"])
    assert second["unseeded"] != third["unseeded"]  # NumPy's global generator is seeded anew in each, as at import
    status = project.conveyor("server", "status")
    assert "imported for their runs: " in status.stdout, status.stdout
    named = status.stdout.split("imported for their runs: ")[1].split(";")[0].split(", ")
    assert named == learned(home)
    assert {"numpy", "pandas", "pyarrow", "dask.dataframe", "scipy", "sklearn", "xgboost"} <= set(named), named


def test_a_module_of_the_project_named_like_a_learned_library_is_not_replaced_by_the_library(
        make_project: Callable[[], Project], home: Path) -> None:
    """The project's own ``xgboost.py`` (its root is first on a run's sys.path): each run imports it, and
    the runner, whose import of that name would find the library, does not learn it; once the runner
    has learned the library from another project's runs, this project's runs still import their own
    (each a fresh process in place of the forked one), from its root, a folder below or with ``-c``."""
    uses = "import xgboost\n\n\ndef use(ctx):\n    ctx.out().write_text(xgboost.__file__)\n"
    project = task_project(make_project, home, uses, "used.txt")
    project.write("xgboost.py", "MINE = True\n")
    for _ in range(2):
        done = project.conveyor("run", "-f")
        assert done.returncode == 0, done.stdout + done.stderr
        assert (project.root / "used.txt").read_text() == str(project.root / "xgboost.py")
    assert served(home) == 2 and "xgboost" not in learned(home)
    other = task_project(make_project, home, uses, "used.txt")
    for _ in range(2):
        assert other.conveyor("run", "-f").returncode == 0
    assert "xgboost" in learned(home) and "site-packages" in (other.root / "used.txt").read_text()
    spec = str(project.root / "configs/pipeline.yaml")
    for where, args in ((project.root, ()), (project.root / "tasks", ()), (other.root, ("-c", spec))):
        (project.root / "used.txt").unlink()
        done = project.conveyor("run", "-f", *args, cwd=where)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (project.root / "used.txt").read_text() == str(project.root / "xgboost.py"), where
    assert served(home) == 7


def test_no_runner_when_turned_off(make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    for env in ({"CONVEYOR_WARM": "0"}, {"CONVEYOR_SERVER_IDLE": "0"}, {"CONVEYOR_WARM_IDLE": "0"}):
        done = project.conveyor("run", "-f", env=env)
        assert done.returncode == 0, done.stderr
    assert not runners(home)  # one would be there already: the run it starts is forked by it
    # nor for a command whose standard input is closed (no descriptor to hand over): it runs here
    closed = subprocess.run(["sh", "-c", "exec conveyor run -f <&-"], cwd=project.root, env=project.env,
                            capture_output=True, text=True, timeout=300)
    assert closed.returncode == 0, closed.stderr
    assert not runners(home)


def _wait_for(path: Path, run: subprocess.Popen[str], deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_a_runner_is_named_by_the_user_and_the_configuration_not_the_terminal() -> None:
    from conveyor.cli.warm import address, key

    assert address("k").startswith("\0conveyor-warm-") and str(os.getuid()) in address("k")
    before = key()
    os.environ["COLUMNS"] = "7"
    assert key() == before  # a terminal's width is not the process's configuration
    os.environ.update(DVC_STAGE="train", DVC_EXP_NAME="goosy-aqua", DVC_EXP_BASELINE_REV="2457f05d")
    assert key() == before  # nor the stage and experiment DVC runs it for (each experiment has its own)
    os.environ["CONVEYOR_OTHER"] = "1"
    assert key() != before
    os.environ["CONVEYOR_WARM_IGNORE"] = "JOB_ID, CONVEYOR_TEST_TAG"
    os.environ["JOB_ID"] = "1"
    ignoring = key()
    os.environ["JOB_ID"] = "2"
    assert key() == ignoring  # named in CONVEYOR_WARM_IGNORE: only the tasks read it, as they run


# A runner's imports (replaced here) take the SIGTERM of `conveyor server stop` and a bare
# `except:` in them swallows its SystemExit, as a library's import may.
SWALLOWED_STOP = """
import os, signal, sys, uuid
from conveyor.cli import warm_runner

def swallowing(task):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # the handler runs here
    except:  # noqa: E722
        pass

warm_runner._preload = swallowing
read, write = os.pipe()  # the write end: what it closes once it listens
warm_runner.serve(uuid.uuid4().hex, write)
print("ended")
"""


def test_a_runner_stopped_while_it_imports_ends_even_where_an_import_swallowed_the_stop(tmp_path: Path) -> None:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path), "CONVEYOR_WARM_IDLE": "600"}
    done = subprocess.run([sys.executable, "-c", SWALLOWED_STOP], env=env, capture_output=True, text=True,
                          timeout=60)  # else it serves for its 600 s
    assert done.returncode == 0 and done.stdout == "ended\n", done.stdout
    assert not list((tmp_path / "conveyor-server/warm").glob("*.json"))  # no longer listed


# A runner whose imports (replaced here) last until the file ``release`` exists, under the key argv[1];
# and a command (``conveyor status``) handed to the runner of that key.
SLOW_IMPORTS = """
import os, sys, time
from conveyor.cli import warm_runner

def importing(task):
    while not os.path.exists("release"):
        time.sleep(0.02)

warm_runner._preload = importing
read, write = os.pipe()  # the write end: what it closes once it listens
warm_runner.serve(sys.argv[1], write)
"""
HANDED_OVER = """
import sys
from conveyor.cli import warm
warm.handed_over(sys.argv[1], ["status"])
print("not handed over")
"""


def queued(runner_key: str) -> int:
    """The connections in the listening queue of the runner of ``runner_key`` (``/proc/net/unix`` lists
    them under its name, beside the listener)."""
    from conveyor.cli.warm import address

    name = "@" + address(runner_key)[1:]
    lines = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return sum(1 for fields in lines if fields[-1] == name and fields[3] == "00000000")


def catches_ctrl_z(pid: int) -> bool:
    """Whether process ``pid`` has a handler of SIGTSTP (``SigCgt`` in ``/proc/PID/status``)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTSTP - 1) & 1)


def test_commands_wait_for_a_runner_that_imports_and_ctrl_c_ends_one_at_once_with_nothing_run(
        tmp_path: Path) -> None:
    import uuid

    runner_key = uuid.uuid4().hex
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "CONVEYOR_WARM_IDLE": "600"}
    runner = subprocess.Popen([sys.executable, "-c", SLOW_IMPORTS, runner_key], cwd=tmp_path, env=env)
    commands: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "home/conveyor-server/warm").glob("*.json")):  # listed: it listens
            assert runner.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)

        def waiting() -> subprocess.Popen[str]:
            before = queued(runner_key)
            command = subprocess.Popen([sys.executable, "-c", HANDED_OVER, runner_key], cwd=tmp_path, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            commands.append(command)
            while queued(runner_key) == before or not catches_ctrl_z(command.pid):  # connected, its
                assert command.poll() is None, command.communicate()  # handlers set (Ctrl-Z's the last): waits
                time.sleep(0.02)
            return command

        abandoned = waiting()
        abandoned.send_signal(signal.SIGINT)
        out, err = abandoned.communicate(timeout=10)
        assert abandoned.returncode == -signal.SIGINT and out == err == "", (out, err)  # ended of it, at once
        kept = waiting()
        (tmp_path / "release").touch()  # the imports end: the runner serves the command that still waits
        out, err = kept.communicate(timeout=60)
        assert kept.returncode == 2 and "not handed over" not in out, out + err  # `status` with no project here
        assert served(tmp_path / "home") == 1  # the abandoned one was never forked
        assert psutil.Process(runner.pid).children() == []
    finally:
        for proc in (*commands, runner):
            proc.kill()
            proc.wait()


def _on_a_terminal(project: Project, env: dict[str, str]) -> bytes:
    """``conveyor run -f`` with a pseudo-terminal as its stdin, stdout and stderr: what the terminal shows,
    run ids, flow run ids and durations masked."""
    import pty
    import re

    leader, follower = pty.openpty()
    proc = subprocess.Popen(["conveyor", "run", "-f"], cwd=project.root, env={**project.env, **env},
                            stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the last process holding the terminal ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, shown
    for pattern, mask in ((rb"\d{8}T\d{6}-[0-9a-f]{6}", b"ID"), (rb"\d+\.\d+(s|x)", b"T"),
                          (rb"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", b"UUID")):
        shown = re.sub(pattern, mask, shown)
    return shown


@pytest.mark.slow
def test_on_a_terminal_a_forked_run_shows_what_a_fresh_process_shows(
        make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    # DO_NOT_TRACK: Prefect prints a notice on the first terminal that imports it (once per PREFECT_HOME)
    project.env.update(TERM="xterm-256color", DO_NOT_TRACK="1")
    assert project.conveyor("run").returncode == 0
    ready(home)
    fresh = _on_a_terminal(project, {"CONVEYOR_WARM": "0"})
    forked = _on_a_terminal(project, {})
    assert runners(home)[0].pid in forked_by(project)
    assert b"\x1b[1m" in fresh and b"\x1b[32m" in forked  # colours: the terminal is one, to both
    # what stays on the terminal once the live view ended (its frames depend on timing), byte for byte
    assert forked.rpartition(b"\x1b[?25h")[2] == fresh.rpartition(b"\x1b[?25h")[2]


@pytest.mark.slow
def test_a_forked_run_reads_the_prefect_settings_files_of_its_own_directory(
        make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    assert project.conveyor("run").returncode == 0
    ready(home)

    def flow_run_url() -> str:
        done = project.conveyor("run", "-f")
        assert done.returncode == 0, done.stderr
        assert runners(home)[0].pid in forked_by(project)
        return str(json.loads((project.root / ".conveyor/runs/latest.json").read_text())["flow_run_url"])

    project.write("prefect.toml", 'ui_url = "http://127.0.0.1:9/custom-ui"\n')  # read where the run runs
    assert flow_run_url().startswith("http://127.0.0.1:9/custom-ui/runs/flow-run/")
    (project.root / "prefect.toml").unlink()  # and no longer, once gone: the runner's own settings again
    assert not flow_run_url().startswith("http://127.0.0.1:9/custom-ui")


@pytest.mark.slow
def test_a_command_without_its_standard_input_runs_by_itself(make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    assert project.conveyor("run").returncode == 0
    ready(home)
    done = subprocess.run(["conveyor", "run", "-f"], cwd=project.root, env=project.env, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: os.close(0))  # no descriptor 0 to hand over
    assert done.returncode == 0, done.stderr
    assert forked_by(project) == []  # run here, as before the runner
    assert json.loads((project.root / ".conveyor/runs/latest.json").read_text())["status"] == "succeeded"


HOLD_TASK = """
import time


def hold(ctx):
    (ctx.root / "started").touch()
    while not (ctx.root / "release").exists():
        time.sleep(0.05)
    (ctx.root / "held.txt").write_text("held\\n")
"""


@pytest.mark.slow
def test_a_forked_run_is_named_by_the_command_that_asked_for_it_also_under_dvc_repro(
        make_project: Callable[[], Project], home: Path) -> None:
    project = warm_project(make_project, home)
    project.write("tasks/__init__.py", "")
    project.write("tasks/hold.py", HOLD_TASK)
    (project.root / "dvc.yaml").unlink()
    project.write("configs/pipeline.yaml", """
        pipeline: named
        stages:
          quick: {cmd: echo quick > quick.txt, outs: [quick.txt]}
          hold: {task: tasks.hold:hold, outs: [held.txt]}
    """)
    assert project.conveyor("run", "quick").returncode == 0
    assert project.conveyor("compile").returncode == 0
    ready(home)

    run = project.popen("run", "hold")  # forked: the lock names this command, not the runner's child
    _wait_for(project.root / "started", run)
    status = project.conveyor("status")
    assert f"a run is in progress (pid {run.pid})" in status.stdout + status.stderr, status.stdout + status.stderr
    refused = project.conveyor("run", "quick")
    assert refused.returncode == 1 and "another conveyor run holds" in refused.stderr and f"(pid {run.pid})" \
        in refused.stderr, refused.stderr
    (project.root / "release").touch()
    assert run.wait(timeout=120) == 0

    for name in ("started", "release"):
        (project.root / name).unlink()
    repro = subprocess.Popen(["dvc", "repro", "-f", "hold"], cwd=project.root, env=project.env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # `conveyor exec hold`, forked
    _wait_for(project.root / "started", repro)
    refused = project.conveyor("run", "quick")
    assert refused.returncode == 1 and "DVC is running in" in refused.stderr, refused.stderr
    (project.root / "release").touch()
    output, _ = repro.communicate(timeout=120)
    assert repro.returncode == 0, output
    assert served(home) >= 5  # the run, status, the refused runs and the exec


def test_a_child_keeps_conveyors_modules_only_while_their_files_are_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept, a forked run saves importing conveyor again; an edit (of an editable install, or an
    upgrade in place) of any file the runner read makes the child read conveyor from disk anew."""
    from conveyor.cli import warm_child

    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    monkeypatch.setattr(warm_child, "IMPORTED", {})
    assert not warm_child._conveyor_unchanged()  # nothing recorded: nothing to keep
    monkeypatch.setitem(warm_child.IMPORTED, str(module), warm_child._signature(str(module)))
    assert warm_child._conveyor_unchanged()
    stat = module.stat()
    module.write_text("x = 2\n")  # the same size, and its mtime put back: the ctime still moves
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not warm_child._conveyor_unchanged()
    monkeypatch.setitem(warm_child.IMPORTED, str(module), warm_child._signature(str(module)))
    module.unlink()
    assert not warm_child._conveyor_unchanged()


def test_a_child_reading_conveyor_anew_drops_bytecode_of_the_version_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit in the second the runner compiled the file, its size kept: Python would take the pyc."""
    from conveyor.cli import warm_child

    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    second = int(time.time()) - 100
    os.utime(module, ns=(second * 10**9, second * 10**9))
    cached = Path(importlib.util.cache_from_source(str(module)))
    py_compile.compile(str(module), cfile=str(cached), doraise=True)
    os.utime(cached, ns=(second * 10**9 + 4 * 10**8,) * 2)  # compiled in that second
    monkeypatch.setattr(warm_child, "IMPORTED", {str(module): warm_child._signature(str(module))})
    assert warm_child._doubtful_bytecode_dropped() == []  # unchanged: kept
    module.write_text("x = 2\n")
    os.utime(module, ns=(second * 10**9 + 7 * 10**8,) * 2)
    assert warm_child._doubtful_bytecode_dropped() == [cached]
