"""Every socket a run opens listens on 127.0.0.1: the temporary Prefect server, the Dask
scheduler, its workers and nannies and their dashboards, and XGBoost's tracker."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest
from prefect_homes import new_home
from projects import Project
from subprocs import wait_for

pytestmark = pytest.mark.slow

HOLD = """
    import time


    def hold(ctx):
        (ctx.root / "started").touch()
        while not (ctx.root / "release").exists():
            time.sleep(0.05)
        (ctx.root / "out.txt").write_text(str(ctx.n_workers))
"""


def listening(processes: list[psutil.Process]) -> list[tuple[str, int, str]]:
    """(address, port, command) of every socket these processes listen on."""
    found = []
    for proc in processes:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((conn.laddr.ip, conn.laddr.port, " ".join(proc.cmdline())))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_a_run_listens_on_loopback_only(make_project: Callable[[], Project],
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    project = make_project()
    project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
    project.env["PREFECT_HOME"] = str(new_home(tmp_path_factory.mktemp("prefect-home")))
    project.write("tasks/__init__.py", "")
    project.write("tasks/hold.py", HOLD)
    project.write("configs/pipeline.yaml", """
        pipeline: sockets
        profiles:
          cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
        stages:
          hold: {task: "tasks.hold:hold", on: cpu, outs: [out.txt]}
    """)
    proc = project.popen("run")
    try:
        wait_for(project.root / "started", proc, 240)
        sockets = listening([psutil.Process(proc.pid), *project.tagged_processes()])
    finally:
        (project.root / "release").touch()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    commands = " | ".join(command for *_, command in sockets)
    assert "create_app" in commands  # the temporary Prefect server
    assert len(sockets) >= 4, sockets  # server, scheduler, dashboard, workers
    assert {ip for ip, *_ in sockets} == {"127.0.0.1"}, sockets


def test_xgboosts_tracker_binds_the_schedulers_host() -> None:
    from conveyor.train.xgb import tracker_host

    assert tracker_host("tcp://127.0.0.1:8786") == "127.0.0.1"
    assert tracker_host("tcp://10.1.2.3:8786") == "10.1.2.3"  # an existing cluster: its scheduler's network
    assert tracker_host("inproc://10.1.2.3/123/1") == "127.0.0.1"
