"""`deterministic: true`: a stage's numeric libraries load with pinned kernel paths and one thread.

A task runs in a process of its own started with them (the runner's process loaded NumPy
long before), a command gets them in its environment; the rest of the run is untouched.
The bytes this buys, across kernel paths, are checked on the reference pipeline
(tests/e2e/test_reference.py) and on a `conveyor init` project (tests/cli/test_init.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import psutil
from projects import Project

from conveyor.run.determinism import PINS, pinned_environ

TASKS = '''
import json
import os
import subprocess
import sys

SEEN = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "NPY_DISABLE_CPU_FEATURES")


def probe(ctx):
    ctx.progress.start(3, unit="steps")
    for _ in range(3):
        ctx.progress.advance(1)
    ctx.log.info("probing from a process of its own")
    print("a print of the task")
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\\0", b" ").decode()
    ctx.out().write_text(json.dumps({"pid": os.getpid(), "env": {k: os.environ.get(k) for k in SEEN},
                                     "value": ctx.params["probe"]["value"], "threads": ctx.n_workers,
                                     "executor": ctx.executor is not None, "parent": parent,
                                     "ppid": os.getppid()}))


def plain(ctx):
    ctx.out().write_text(json.dumps({"pid": os.getpid(), "env": {k: os.environ.get(k) for k in SEEN}}))


def flaky(ctx):
    ctx.out().write_text("half written")
    if (ctx.root / "kill").exists():  # as the kernel's OOM killer ends a process
        with (ctx.root / "attempts.txt").open("a") as attempts:
            attempts.write("attempt\\n")
        os.kill(os.getpid(), 9)
    if (ctx.root / "break").exists():
        raise ValueError(f"no rows in {ctx.root / 'break'}\\nsecond line")
    ctx.out().write_text("complete")
'''

SPEC = '''
pipeline: pinned
profiles: {io: {kind: threads, max_workers: 3}}
stages:
  probe: {task: tasks.steps:probe, on: io, deterministic: true, params: [probe], outs: [out/probe.json]}
  plain: {task: tasks.steps:plain, outs: [out/plain.json]}
  command:
    cmd: python -c "import json, os; print(json.dumps(dict(os.environ)))" > out/command.json
    deterministic: true
    outs: [out/command.json]
  flaky: {task: tasks.steps:flaky, deterministic: true, outs: [out/flaky.txt]}
'''


def _pinned_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", "probe: {value: 7}\n")
    project.write("configs/pipeline.yaml", SPEC)
    (project.root / "out").mkdir()
    return project


def test_a_deterministic_task_runs_in_a_process_of_its_own_with_the_pins(make_project: Callable[[], Project]) -> None:
    project = _pinned_project(make_project)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = {pid: project.root / f".conveyor/isolated-{pid}-x" for pid in (int(gone.stdout), os.getpid())}
    for folder in left.values():  # a runner killed mid-stage left its payload folder; a live one's stays
        folder.mkdir(parents=True)
    users = {**project.env, "OPENBLAS_CORETYPE": "Haswell"}  # set for every process on some machines
    done = project.conveyor("run", env=users)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left[int(gone.stdout)].exists() and left[os.getpid()].exists()

    probe = json.loads((project.root / "out/probe.json").read_text())
    plain = json.loads((project.root / "out/plain.json").read_text())
    assert probe["pid"] != plain["pid"]  # plain ran in the runner's process, probe in a child
    assert probe["env"]["ATEN_CPU_CAPABILITY"] == "default" and probe["env"]["MKL_CBWR"] == "COMPATIBLE"
    assert probe["env"]["OPENBLAS_CORETYPE"] == PINS["OPENBLAS_CORETYPE"] and probe["env"]["OMP_NUM_THREADS"] == "1"
    assert probe["env"]["NPY_DISABLE_CPU_FEATURES"]  # every feature this NumPy dispatches to at run time
    assert (probe["value"], probe["threads"], probe["executor"]) == (7, 3, True)  # params, its own thread pool
    assert plain["env"] == {k: users.get(k) for k in plain["env"]}  # the pins never reach the runner's own process
    command = json.loads((project.root / "out/command.json").read_text())
    assert {k: command[k] for k in PINS} == dict(PINS)

    record = project.record()
    assert record["stages"]["probe"]["deterministic"]["ATEN_CPU_CAPABILITY"] == "default"
    assert record["stages"]["command"]["deterministic"]["MKL_CBWR"] == "COMPATIBLE"
    assert record["stages"]["plain"]["deterministic"] is None
    log = (project.root / f".conveyor/logs/{record['run_id']}/probe.log").read_text()
    assert "probing from a process of its own" in log and "a print of the task" in log
    assert "conveyor-progress" not in log  # progress lines travel to the live view, not the log
    assert not project.left_running()


def test_a_deterministic_task_is_forked_by_a_warm_runner_started_with_the_pins(
        make_project: Callable[[], Project]) -> None:
    """A run's deterministic tasks are handed to a warm runner of their pinned environment, which the run
    starts (not from under the stage's guard, which would end it with the stage): it imports the task's
    libraries once, with the pins, and forks each task. Without runners, a fresh interpreter as before."""
    project = _pinned_project(make_project)
    seen = []
    for env in ({}, {}, {"CONVEYOR_WARM": "0"}):
        done = project.conveyor("run", "-f", "probe", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        seen.append(json.loads((project.root / "out/probe.json").read_text()))
    forked, again, fresh = seen
    assert "conveyor.cli.warm_runner" in forked["parent"] and "task=True" in forked["parent"], forked["parent"]
    assert again["parent"] == forked["parent"] and again["pid"] != forked["pid"]  # the same runner: a child each
    assert "conveyor.cli.warm_runner" not in fresh["parent"]
    assert forked["env"] == again["env"] == fresh["env"]
    assert forked["env"]["OMP_NUM_THREADS"] == "1" and forked["env"]["ATEN_CPU_CAPABILITY"] == "default"
    runner = psutil.Process(forked["ppid"]).environ()  # its imports saw the pins, not a test's tag
    assert runner["OMP_NUM_THREADS"] == "1" and runner["OPENBLAS_CORETYPE"] == PINS["OPENBLAS_CORETYPE"]
    assert "CONVEYOR_TEST_TAG" not in runner  # a variable CONVEYOR_WARM_IGNORE names, as a run's runner
    # nor what the run set itself (its Prefect client's bounds; a library's as it loaded: scikit-learn's KMP_*)
    assert "PREFECT_CLIENT_MAX_RETRIES" not in project.env and "PREFECT_CLIENT_MAX_RETRIES" not in runner
    assert not project.left_running()


def test_a_deterministic_task_that_fails_names_its_error_and_leaves_the_previous_outs(
        make_project: Callable[[], Project]) -> None:
    project = _pinned_project(make_project)
    assert project.conveyor("run", "flaky").returncode == 0
    (project.root / "break").write_text("")

    failed = project.conveyor("run", "-f", "-s", "flaky")
    assert failed.returncode == 1
    assert f"stage 'flaky' failed: ValueError: no rows in {project.root / 'break'}" in failed.stdout
    assert (project.root / "out/flaky.txt").read_text() == "complete"  # the previous out, put back
    record = project.record()
    log = (project.root / f".conveyor/logs/{record['run_id']}/flaky.log").read_text()
    assert "Traceback" in log and "second line" in log  # the whole story is in the stage's log

    (project.root / "kill").write_text("")  # its process killed: the stage fails once, not run again
    killed = project.conveyor("run", "-f", "-s", "flaky")
    assert killed.returncode == 1 and "killed by signal 9" in " ".join(killed.stdout.split()), killed.stdout
    assert (project.root / "attempts.txt").read_text() == "attempt\n"
    assert (project.root / "out/flaky.txt").read_text() == "complete"
    assert not project.left_running()


def test_a_deterministic_task_on_dask_workers_is_a_spec_error(make_project: Callable[[], Project]) -> None:
    project = _pinned_project(make_project)
    project.write("configs/pipeline.yaml", '''
        pipeline: pinned
        profiles: {cpu: {kind: dask, n_workers: 1}}
        stages:
          plain: {task: tasks.steps:plain, on: cpu, deterministic: true, outs: [out/plain.json]}
        ''')
    checked = project.conveyor("validate")
    assert checked.returncode == 2
    assert "configs/pipeline.yaml:4 stages.plain.deterministic: a deterministic task runs in a process of its " \
           "own" in checked.stderr
    assert "Traceback" not in checked.stderr


def test_the_pins_add_to_glibc_tunables_a_user_already_set() -> None:
    pins = pinned_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert pins["GLIBC_TUNABLES"].startswith("glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX2,-FMA")
    assert pinned_environ({})["GLIBC_TUNABLES"].startswith("glibc.cpu.hwcaps=")
    assert pinned_environ(dict(os.environ))["NPY_ENABLE_CPU_FEATURES"] == ""  # NumPy refuses both set at once


def test_the_pins_are_worked_out_without_importing_numpy_in_the_runner() -> None:
    """Importing NumPy from a stage's thread raced a task importing it in another (a half-initialised module)."""
    probe = ("import sys\nfrom conveyor.run.determinism import pinned_environ\n"
             "pins = pinned_environ({})\nassert 'numpy' not in sys.modules, 'numpy imported'\n"
             "print(pins.get('NPY_DISABLE_CPU_FEATURES', ''))")
    checked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    import numpy as np

    dispatched = getattr(np._core._multiarray_umath, "__cpu_dispatch__", [])
    assert checked.stdout.split() == list(dispatched)
