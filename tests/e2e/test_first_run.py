"""What a newcomer sees: a quiet terminal, logs per stage, a summary that says what came out.

Real CLI in a subprocess, real Prefect server (the session's), real Dask workers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from projects import Project

TASKS = '''
import json, logging, os, threading


def loud(ctx):
    print("printed by the task")
    ctx.log.info("logged through ctx.log")
    logging.getLogger("distributed.client").warning("a library warning from the stage thread")
    os.write(2, b"written below python to fd 2\\n")
    side = threading.Thread(target=lambda: print("printed by a library thread"))
    side.start()
    side.join()
    ctx.out().write_text("x")
    ctx.metric().write_text(json.dumps({"auc": 0.91234, "nested": {"loss": 0.2}, "name": "not a number"}))


def on_dask(ctx):
    import dask.array as da
    total = int(da.ones((100, 100), chunks=50).sum().compute())
    ctx.out().write_text(str(total))


def broken(ctx):
    print("about to break")
    raise RuntimeError("broke on purpose")
'''

SPEC = '''
pipeline: quiet
profiles:
  cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
stages:
  loud: {task: tasks.steps:loud, outs: [out/loud.txt], metrics: [metrics/loud.json]}
  crunch: {task: tasks.steps:on_dask, on: cpu, deps: [out/loud.txt], outs: [out/crunch.txt]}
'''

NOISE = ["printed by the task", "logged through ctx.log", "a library warning", "written below python",
         "printed by a library thread", "distributed.scheduler", "Starting temporary server", "Task run"]


def quiet_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("configs/pipeline.yaml", SPEC)
    return project


@pytest.mark.slow
def test_terminal_shows_the_run_and_the_logs_have_the_rest(make_project: Callable[[], Project]) -> None:
    project = quiet_project(make_project)
    result = project.conveyor("run")
    assert result.returncode == 0, result.stderr
    terminal = result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in terminal, noise
    run_id = project.record()["run_id"]
    logs = project.root / ".conveyor/logs" / run_id

    # the summary: metrics, outputs, logs, record, the flow run in Prefect's UI
    assert re.search(r"metrics: loud auc 0\.9123  nested\.loss 0\.2  \[metrics/loud\.json\]", terminal), terminal
    assert "outputs: out/loud.txt, out/crunch.txt" in terminal
    assert f"logs:    .conveyor/logs/{run_id}/" in terminal
    assert f"record:  .conveyor/runs/{run_id}.json" in terminal
    api = project.env["PREFECT_API_URL"].removesuffix("/api")
    assert f"prefect: {api}/runs/flow-run/{project.record()['flow_run_id']}" in terminal
    assert project.record()["stages"]["loud"]["metrics"] == {"auc": 0.91234, "nested.loss": 0.2}

    # the stage's own log: its prints, ctx.log and the libraries it called from its thread
    stage_log = (logs / "loud.log").read_text()
    assert "\nprinted by the task\n" in stage_log
    assert re.search(r"\d\d:\d\d:\d\d INFO +logged through ctx\.log", stage_log)
    assert "a library warning from the stage thread" in stage_log
    # what no stage claims: C-level writes, other threads, Prefect, the Dask cluster
    run_log = (logs / "run.log").read_text()
    for line in ("written below python to fd 2", "printed by a library thread", "Beginning flow run",
                 "distributed.scheduler"):
        assert line in run_log, line

    shown = project.conveyor("logs", "loud")
    assert shown.returncode == 0 and "printed by the task" in shown.stdout
    assert f"run {run_id}" in shown.stderr
    gone = project.conveyor("logs", "loud", "--run", "20000101T000000-000000")
    assert gone.returncode == 2 and "no run '20000101T000000-000000'" in gone.stderr

    # -v: the same lines on the terminal too
    verbose = project.conveyor("run", "-f", "-v", "loud")
    assert verbose.returncode == 0, verbose.stderr
    for line in ("printed by the task", "written below python to fd 2", "printed by a library thread"):
        assert line in verbose.stdout + verbose.stderr, line

    # a skipped stage's log is the one of the last run that ran it
    again = project.conveyor("run")
    assert again.returncode == 0
    assert project.conveyor("logs", "crunch").stdout == (logs / "crunch.log").read_text()


@pytest.mark.slow
def test_a_failed_stage_points_at_its_log(make_project: Callable[[], Project]) -> None:
    project = quiet_project(make_project)
    project.write("configs/pipeline.yaml", SPEC.replace("tasks.steps:on_dask", "tasks.steps:broken"))
    result = project.conveyor("run")
    assert result.returncode == 1
    run_id = project.record()["run_id"]
    assert "crunch failed: RuntimeError: broke on purpose" in result.stdout
    assert f"its log: .conveyor/logs/{run_id}/crunch.log  (conveyor logs crunch)" in result.stdout
    assert "about to break" in project.conveyor("logs", "crunch").stdout


CMDS = '''
pipeline: chain
params: params.yaml
stages:
  a: {cmd: "mkdir -p out && echo ${a.n} > out/a.txt", params: [a], outs: [out/a.txt]}
  b: {cmd: "cat out/a.txt > out/b.txt && echo ${b.n} >> out/b.txt", params: [b], deps: [out/a.txt],
      outs: [out/b.txt]}
'''


@pytest.mark.slow
def test_single_item_status_exit_code_and_reasons_in_plain_words(make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("params.yaml", "a: {n: 1}\nb: {n: 2}\n")
    project.write("configs/pipeline.yaml", CMDS)
    first = project.conveyor("status", "--exit-code")
    assert first.returncode == 1 and "never run" in first.stdout
    assert project.conveyor("run").returncode == 0
    assert project.conveyor("status", "--exit-code").returncode == 0

    project.write("params.yaml", "a: {n: 5}\nb: {n: 3}\n")
    status = project.conveyor("status", "--exit-code")
    assert status.returncode == 1
    assert "params changed: a.n 1 → 5" in status.stdout and "params changed: b.n 2 → 3" in status.stdout

    single = project.conveyor("run", "-s", "b")  # b alone: a stays stale, as with dvc repro -s
    assert single.returncode == 0, single.stderr
    assert list(project.record()["stages"]) == ["b"]
    assert (project.root / "out/b.txt").read_text().split() == ["1", "3"]
    assert "params changed: b.n 2 → 3" in single.stdout
    after = project.conveyor("status")
    assert re.search(r"a\s+│\s+stale\s+│\s+params changed: a\.n 1 → 5", after.stdout), after.stdout
    assert json.loads((project.root / ".conveyor/runs/latest.json").read_text())["status"] == "succeeded"
