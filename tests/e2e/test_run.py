"""`conveyor run` end to end on small projects: real CLI, real Prefect server, real Dask.

The DAG used by most tests::

    a ──► b ──► d
    └───► c ──┘
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from prefect_homes import new_home
from projects import Project, prefect_api
from subprocs import cmdline, wait_for

TASKS = '''
import json, os, threading, time
from pathlib import Path

# b and c both wait here: the run only gets past it if the two stages run at the same time.
RENDEZVOUS = threading.Barrier(2, timeout=60)


def write(ctx):
    for path in [*ctx.outs.values(), *ctx.metrics.values()]:
        path.write_text(json.dumps({"stage": ctx.stage, "params": dict(ctx.params)}))


def meet(ctx):
    RENDEZVOUS.wait()
    write(ctx)


def fail(ctx):
    raise RuntimeError(f"{ctx.stage} broke on purpose")


def half_write_then_fail(ctx):
    ctx.out("out/b.txt").write_text("partial")
    raise RuntimeError("died after a partial write")


def flaky(ctx):
    marker = ctx.root / "flaky.count"
    count = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(count))
    if count < 2:
        raise ConnectionError("transient")
    write(ctx)


def slow(ctx):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    write(ctx)


def on_dask(ctx):
    import dask.array as da
    total = int(da.ones((400, 400), chunks=100).sum().compute())
    ctx.out("out/d.txt").write_text(f"{total} {ctx.n_workers}")


def dask_then_wait(ctx):
    import dask.array as da
    da.ones((10, 10), chunks=5).sum().compute()
    (ctx.root / "dask.started").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120  # a training loop: Python code between short C calls
    while time.monotonic() < deadline:
        time.sleep(0.05)
'''


def diamond(project: Project, b: str = "meet", c: str = "meet", d: str = "on_dask", extra: str = "") -> None:
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", "a: {n: 1}\nb: {n: 2}\n")
    project.write("configs/pipeline.yaml", f"""
        pipeline: diamond
        profiles:
          io: {{kind: threads, max_workers: 2}}
          cpu: {{kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}}
        stages:
          a: {{task: tasks.steps:write, on: io, params: [a], outs: [out/a.txt]}}
          b: {{task: tasks.steps:{b}, params: [b], deps: [out/a.txt], outs: [out/b.txt]{extra}}}
          c: {{task: tasks.steps:{c}, deps: [out/a.txt], outs: [out/c.txt]}}
          d: {{task: tasks.steps:{d}, on: cpu, deps: [out/b.txt, out/c.txt], outs: [out/d.txt]}}
        """)


def interval(stage: dict[str, str]) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(stage["started"]), datetime.fromisoformat(stage["finished"])


@pytest.mark.slow
def test_independent_branches_run_at_the_same_time(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project)
    result = project.conveyor("run")
    assert result.returncode == 0, result.stderr
    record = project.record()
    assert record["status"] == "succeeded"
    assert [s["status"] for s in record["stages"].values()] == ["succeeded"] * 4
    (b0, b1), (c0, c1) = interval(record["stages"]["b"]), interval(record["stages"]["c"])
    assert b0 < c1 and c0 < b1, "b and c did not overlap"
    assert record["critical_path"][0] == "a" and record["critical_path"][-1] == "d"
    assert record["critical_path_s"] <= record["stage_sum_s"]
    assert record["speedup"] == pytest.approx(record["stage_sum_s"] / record["wall_s"], rel=1e-2)
    assert (project.root / "out/d.txt").read_text() == "160000 2"
    assert not project.left_running(), "a Dask worker outlived the run"


@pytest.mark.slow
def test_second_run_skips_force_reruns_and_status_says_why(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="write", c="write", d="write")
    assert project.conveyor("run").returncode == 0
    again = project.conveyor("run")
    assert again.returncode == 0
    assert {s["status"] for s in project.record()["stages"].values()} == {"skipped"}
    assert "up to date" in again.stdout
    assert not project.record()["flow_run_id"]  # nothing due: decided before any flow started

    project.write("params.yaml", "a: {n: 1}\nb: {n: 3}\n")
    status = project.conveyor("status")
    assert status.returncode == 0
    lines = {line.split()[1]: line for line in status.stdout.splitlines() if line.strip()[1:3] in
             {" a", " b", " c", " d"}}
    assert "up to date" in lines["a"] and "up to date" in lines["c"]
    assert "params changed: b.n 2 → 3" in lines["b"]
    assert "upstream 'b' is stale" in lines["d"]

    assert project.conveyor("run").returncode == 0
    stages = project.record()["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {
        "a": "skipped", "b": "succeeded", "c": "skipped", "d": "succeeded"}
    assert stages["b"]["reason"] == "params changed: b.n 2 → 3"
    assert task_run_names(project, project.record()["flow_run_id"], expected=2) == ["b", "d"]  # skipped: no task run

    assert project.conveyor("run", "c", "--force").returncode == 0
    stages = project.record()["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {"a": "succeeded", "c": "succeeded"}
    assert stages["c"]["reason"] == "forced"


@pytest.mark.slow
def test_failure_stops_dependents_and_independent_branch_finishes(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="fail", c="write", d="write")
    result = project.conveyor("run")
    assert result.returncode == 1
    stages = project.record()["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {
        "a": "succeeded", "b": "failed", "c": "succeeded", "d": "not_run"}
    assert "b broke on purpose" in stages["b"]["error"]
    assert stages["d"]["reason"] == "upstream 'b' failed"
    assert project.record()["status"] == "failed"
    assert "not run: d" in result.stdout
    assert "resume with: conveyor run b --downstream" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_failed_stage_leaves_previous_outs_intact(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="write", c="write", d="write")
    assert project.conveyor("run").returncode == 0
    before = (project.root / "out/b.txt").read_bytes()
    diamond(project, b="half_write_then_fail", c="write", d="write")
    project.write("params.yaml", "a: {n: 1}\nb: {n: 4}\n")
    assert project.conveyor("run").returncode == 1
    assert (project.root / "out/b.txt").read_bytes() == before
    assert not list((project.root / "out").glob(".conveyor-tmp*"))


@pytest.mark.slow
def test_retries_and_timeout(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="flaky", c="slow", d="write",
            extra=", retries: 2, retry_delay_s: 0")
    text = (project.root / "configs/pipeline.yaml").read_text()
    text = text.replace("outs: [out/c.txt]}", "outs: [out/c.txt], timeout_s: 2}")
    (project.root / "configs/pipeline.yaml").write_text(text)
    result = project.conveyor("run")
    assert result.returncode == 1
    stages = project.record()["stages"]
    assert stages["b"]["status"] == "succeeded" and stages["b"]["attempts"] == 2
    assert stages["c"]["status"] == "failed"
    assert "Timeout" in stages["c"]["error"] or "timed out" in stages["c"]["error"].lower()
    assert stages["c"]["duration_s"] < 30
    assert stages["d"]["status"] == "not_run"


@pytest.mark.slow
def test_failed_dask_stage_leaves_no_worker(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="write", c="write", d="fail")
    assert project.conveyor("run").returncode == 1
    assert project.record()["stages"]["d"]["status"] == "failed"
    assert not project.left_running(), "a Dask worker outlived the failed run"


@pytest.mark.slow
def test_interrupt_stops_the_cluster(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project, b="write", c="write", d="dask_then_wait")
    proc = project.popen("run")
    marker = project.root / "dask.started"
    deadline = time.monotonic() + 180
    while not marker.exists():  # the stage itself announces it is running on the cluster
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "the dask stage never started"
        time.sleep(0.1)
    assert len(project.tagged_processes()) > 1  # the run and its Dask workers
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in out
    gone_by = time.monotonic() + 30
    while project.tagged_processes() and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not project.left_running(), "processes outlived an interrupted run"
    assert not (project.root / "out/d.txt").exists()


def test_bad_spec_and_bad_usage_exit_2(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project)
    unknown = project.conveyor("run", "nope")
    assert unknown.returncode == 2 and "unknown stage(s): nope" in unknown.stderr
    override = project.conveyor("run", "--profile", "cpu=gpuu")
    assert override.returncode == 2 and "unknown profile 'gpuu'" in override.stderr
    text = (project.root / "configs/pipeline.yaml").read_text().replace("on: cpu", "on: cpuu")
    (project.root / "configs/pipeline.yaml").write_text(text)
    bad = project.conveyor("run")
    assert bad.returncode == 2
    assert "configs/pipeline.yaml:9 stages.d.on: unknown profile 'cpuu' (did you mean 'cpu'?)" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_dag_formats(make_project: Callable[[], Project]) -> None:
    project = make_project()
    diamond(project)
    text = project.conveyor("dag").stdout
    assert "d (cpu)  <- b, c" in text
    mermaid = project.conveyor("dag", "--format", "mermaid").stdout
    ids = dict(re.findall(r'^    (s\d+)\["(\w)', mermaid, re.MULTILINE))  # node id -> stage
    edges = {(ids[a], ids[b]) for a, b in re.findall(r"^    (s\d+) --> (s\d+)$", mermaid, re.MULTILINE)}
    assert mermaid.startswith("flowchart TD") and ("b", "d") in edges and ("a", "b") in edges
    dot = project.conveyor("dag", "--format", "dot").stdout
    assert '"a" -> "b";' in dot and dot.rstrip().endswith("}")


def task_run_names(project: Project, flow_run_id: str, expected: int, deadline_s: float = 30) -> list[str]:
    """The task runs Prefect's server recorded for a flow run, once ``expected`` of them arrived
    (the server records them from events, a moment after the run)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + deadline_s
    with prefect_api(project.env["PREFECT_API_URL"]) as api:
        while True:
            ids = FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])
            names = sorted(r.name for r in api.read_task_runs(flow_run_filter=FlowRunFilter(id=ids)))
            if len(names) >= expected or time.monotonic() > deadline:
                return names
            time.sleep(0.2)


@pytest.mark.slow
def test_the_temporary_prefect_server_ends_with_the_run_even_on_kill_9(
        make_project: Callable[[], Project], tmp_path_factory: pytest.TempPathFactory) -> None:
    project = make_project()
    project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
    project.env["PREFECT_HOME"] = str(new_home(tmp_path_factory.mktemp("prefect-home")))
    project.write("configs/pipeline.yaml", """
        pipeline: hold
        stages:
          hold:
            cmd: touch started && while [ ! -e release ]; do sleep 0.1; done && echo done > done.txt
            outs: [done.txt]
    """)
    proc = project.popen("run")
    try:
        wait_for(project.root / "started", proc, 180)
        # the stage's `sleep 0.1`s come and go while the list is read: a command line read after
        # its process ended is none
        servers = [line for line in map(cmdline, project.tagged_processes())
                   if "prefect.server.api.server:create_app" in line]
        assert len(servers) == 1 and servers[0][servers[0].index("--host") + 1] == "127.0.0.1", servers
    finally:  # killed whatever the checks found: a run left holding its stage would outlive the tests
        proc.kill()
        proc.communicate(timeout=30)
    assert not project.left_running(grace_s=30), "a process outlived the killed run"


def test_a_temporary_server_that_does_not_start_fails_the_run_and_its_record_says_why(
        make_project: Callable[[], Project], tmp_path: Path) -> None:
    project = make_project()
    project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
    (tmp_path / "home").write_text("a file, where Prefect wants its home folder")
    project.env["PREFECT_HOME"] = str(tmp_path / "home")
    project.write("configs/pipeline.yaml", """
        pipeline: noserver
        stages:
          one: {cmd: echo 1 > one.txt, outs: [one.txt]}
    """)
    result = project.conveyor("run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the temporary Prefect server exited" in result.stderr and "Traceback" not in result.stderr
    record = project.record()
    assert record["status"] == "failed"  # not "running": the next command would call it killed
    assert record["stages"]["one"]["status"] == "not_run"
    assert "the run failed before it started: " in record["stages"]["one"]["reason"]
    assert not project.left_running(grace_s=5)
    status = project.conveyor("status")
    assert "was killed" not in status.stderr, status.stderr


@pytest.mark.slow
def test_many_stages_up_to_date_are_one_line_of_the_summary(make_project: Callable[[], Project]) -> None:
    project = make_project()
    chain = "\n".join(f"  s{k:02d}: {{cmd: 'echo {k} > out/s{k:02d}.txt', outs: [out/s{k:02d}.txt]"
                      + (f", deps: [out/s{k - 1:02d}.txt]" if k else "") + "}" for k in range(14))
    project.write("configs/pipeline.yaml", f"pipeline: chain\nstages:\n{chain}\n")
    (project.root / "out").mkdir()
    assert project.conveyor("run").returncode == 0
    project.write("configs/pipeline.yaml", project.root.joinpath("configs/pipeline.yaml").read_text()
                  .replace("echo 13 >", "echo thirteen >"))

    again = project.conveyor("run")
    assert again.returncode == 0, again.stderr
    stages = project.record()["stages"]
    assert [name for name, st in stages.items() if st["status"] == "succeeded"] == ["s13"]
    assert "skipped, up to date: 13 stages (s00 ... s12; `conveyor status` lists each)" in again.stdout
    assert re.search(r"│ s13 +│ succeeded", again.stdout), again.stdout
    assert not re.search(r"│ s0\d ", again.stdout), again.stdout  # no row each for the 13 up to date


def test_a_summary_piped_at_a_narrow_width_keeps_its_title_paths_and_commands_whole(
        make_project: Callable[[], Project]) -> None:
    """``conveyor run > run.txt``: the summary is on stdout, and the lines that are read or copied
    (its title, the dag page command, resume with) are never cut or wrapped mid-phrase."""
    project = make_project()
    name = "a-pipeline-with-a-rather-long-name-for-a-narrow-pipe"
    project.write("configs/pipeline.yaml", f"""
        pipeline: {name}
        stages:
          a: {{cmd: echo a > a.txt, outs: [a.txt]}}
          b: {{cmd: exit 3, deps: [a.txt], outs: [b.txt]}}
    """)
    done = project.conveyor("run", env={"COLUMNS": "50"})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{name} · run ") and lines[0].rstrip().endswith("s"), lines[0]
    assert "dag:     conveyor dag --format html  (a page: b failed, the stages it holds up, and why)" in lines
    assert lines[-1] == "resume with: conveyor run b --downstream"
