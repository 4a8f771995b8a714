"""``timeout_s`` fires whatever a task is doing: a Python loop, a wait on a Dask computation,
one long C call (abandoned: its previous outs go back and the run does not wait for it)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from projects import Project, prefect_api

from conveyor.run.watchdog import TaskTimedOut, Watchdog, stuck

TASKS = """
    import time

    import dask


    def c_call(ctx):
        ctx.out().write_text("new")  # in place, as a script would
        time.sleep(600)  # one C call: no exception lands in it until it returns


    def loop(ctx):
        ctx.out().write_text("new")
        while True:
            sum(range(1000))


    def on_dask(ctx):
        ctx.out().write_text("new")
        ctx.client.submit(time.sleep, 600, pure=False).result()  # the stage's thread waits on Dask


    def quick(ctx):
        ctx.out().write_text(ctx.dep().read_text() + " and quick")
"""

SPEC = """
    pipeline: timeouts
    profiles:
      cpu: {kind: dask, n_workers: 1, threads_per_worker: 1, memory_limit: 1GiB}
    stages:
      c_call: {task: tasks.slow:c_call, outs: [data/c_call.txt], timeout_s: 2}
      loop: {task: tasks.slow:loop, outs: [data/loop.txt], timeout_s: 2, retries: 1, retry_delay_s: 0}
      on_dask: {task: tasks.slow:on_dask, on: cpu, outs: [data/on_dask.txt], timeout_s: 2}
      after: {task: tasks.slow:quick, deps: [data/c_call.txt], outs: [data/after.txt]}
"""


def slow_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("configs/pipeline.yaml", SPEC)
    project.write("tasks/__init__.py", "")
    project.write("tasks/slow.py", TASKS)
    for name in ("c_call", "loop", "on_dask", "after"):
        project.write(f"data/{name}.txt", "old")
    return project


def task_run_states(project: Project) -> dict[str, str]:
    """The final state of each task run of the project's last run, as Prefect's API has it."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = uuid.UUID(project.record()["flow_run_id"])
    with prefect_api(project.env["PREFECT_API_URL"]) as api:
        runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run.state.type.value for run in runs if run.state is not None}


def test_a_python_loop_gets_the_timeout_as_the_body_leaves() -> None:
    with pytest.raises(TaskTimedOut), Watchdog(0.2, on_stuck=lambda: None):
        while True:
            sum(range(100))


def test_a_body_that_swallows_the_timeout_still_timed_out() -> None:
    # the inner suppress is a task's own `except Exception: pass`
    with pytest.raises(TaskTimedOut), Watchdog(0.1, on_stuck=lambda: None), contextlib.suppress(TaskTimedOut):
        time.sleep(0.5)


def test_a_body_that_ends_in_time_is_left_alone() -> None:
    with Watchdog(0.2, on_stuck=lambda: None) as dog:
        sum(range(100))
    time.sleep(0.4)  # past the timeout: nothing may land now
    assert not dog.fired


def test_a_c_call_is_abandoned_after_the_grace() -> None:
    gave_up = threading.Event()
    caught: list[BaseException] = []

    def blocked() -> None:
        try:
            with Watchdog(0.1, on_stuck=gave_up.set, grace_s=0.2):
                time.sleep(3.0)  # one C call: the exception lands only when it returns
        except BaseException as exc:  # what the thread sees, once the call returns
            caught.append(exc)

    thread = threading.Thread(target=blocked)
    t0 = time.monotonic()
    thread.start()
    assert gave_up.wait(5)
    # given up on while the call still runs (at ~0.3 s; the call's 3 s leave a loaded machine room)
    assert thread.is_alive() and time.monotonic() - t0 < 2.5
    assert thread in stuck()  # the process must not wait for it
    thread.join(5)
    assert [type(e) for e in caught] == [TaskTimedOut]  # pending: nothing after the call runs
    assert thread not in stuck()


@pytest.mark.slow
def test_timeouts_fire_in_a_loop_a_dask_wait_and_a_c_call(make_project: Callable[[], Project]) -> None:
    project = slow_project(make_project)
    t0 = time.monotonic()
    result = project.conveyor("run", timeout=300)
    took = time.monotonic() - t0
    assert result.returncode == 1, result.stdout + result.stderr
    stages = project.record()["stages"]
    assert stages["loop"]["status"] == "failed" and stages["loop"]["attempts"] == 2  # retried, timed out again
    assert "timed out after 2s (timeout_s)" in stages["loop"]["error"]
    assert stages["on_dask"]["status"] == "failed"
    assert "timed out after 2s (timeout_s)" in stages["on_dask"]["error"]
    c_call = stages["c_call"]
    assert c_call["status"] == "failed" and "abandoned, its previous outs put back" in c_call["error"], c_call
    assert "cmd stage" in c_call["error"]
    assert c_call["duration_s"] < 2 + 12 + 10
    assert stages["after"]["status"] == "not_run"
    assert took < 120  # the run did not wait for the 600-s call
    assert task_run_states(project) == {"c_call": "FAILED", "loop": "FAILED", "on_dask": "FAILED"}
    for name in ("c_call", "loop", "on_dask", "after"):
        assert (project.root / f"data/{name}.txt").read_text() == "old", name
    assert project.left_running() == []


@pytest.mark.slow
def test_exec_ends_a_stage_blocked_past_its_timeout(make_project: Callable[[], Project]) -> None:
    """``conveyor exec`` (what ``dvc repro`` runs) runs the stage in its main thread."""
    project = slow_project(make_project)
    t0 = time.monotonic()
    result = project.conveyor("exec", "c_call", timeout=120)
    assert result.returncode == 1
    assert "stage 'c_call' failed: timed out after 2s (timeout_s)" in result.stderr  # exec: its one line
    assert "Traceback" not in result.stderr
    assert time.monotonic() - t0 < 60
    assert (project.root / "data/c_call.txt").read_text() == "old"
    assert not list((project.root / ".conveyor/journal").iterdir())
    assert project.left_running() == []
