"""The Prefect server conveyor keeps between runs (no PREFECT_API_URL): joined by later runs,
shared by two projects at once, visible, stopped on demand and after its idle time, also when the
run that used it was killed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from prefect_homes import new_home
from projects import Project, prefect_api
from subprocs import wait_until

pytestmark = pytest.mark.slow

HOLD = "touch started && while [ ! -e release ]; do sleep 0.05; done && echo done > done.txt"


def removed(path: Path) -> bool:
    """``rm -rf path``; whether it is gone (a process may have written in it meanwhile)."""
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


def kept_project(make_project: Callable[[], Project], home: Path, idle: str = "120") -> Project:
    """A project whose runs keep a Prefect server under ``home`` (no PREFECT_API_URL)."""
    project = make_project()
    project.env = {k: v for k, v in project.env.items() if not k.startswith("PREFECT_API")}
    project.env.update(PREFECT_HOME=str(home), CONVEYOR_SERVER_IDLE=idle)
    project.env.pop("CONVEYOR_WARM_IDLE", None)  # the suite's (tests/conftest.py): runners idle as the server
    project.write("configs/pipeline.yaml", """
        pipeline: kept
        stages:
          one: {cmd: echo said-one && echo 1 > one.txt, outs: [one.txt]}
          two: {cmd: echo 2 > two.txt, outs: [two.txt]}
    """)
    return project


def state(home: Path) -> dict[str, object] | None:
    path = home / "conveyor-server/server.json"
    return json.loads(path.read_text()) if path.exists() else None


def keepers(home: Path) -> list[psutil.Process]:
    """The kept servers of ``home`` still running."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "conveyor.prefect.keeper" in proc.cmdline() and str(home) in " ".join(proc.cmdline()) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def gone(proc: psutil.Process) -> bool:
    """Ended (a zombie too: where PID 1 of a container reaps nothing, an orphan that exits stays one)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def flow_runs(url: str) -> list[str]:
    with prefect_api(url) as api:
        return [str(run.id) for run in api.read_flow_runs()]


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A PREFECT_HOME of the test's own; whatever server and warm runners it kept are stopped at the end."""
    from conveyor.cli.warm_state import runners

    home = new_home(tmp_path_factory.mktemp("kept-home"))
    yield home
    for pid in [*(proc.pid for proc in keepers(home)), *(runner.pid for runner in runners(home))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_later_runs_join_the_server_the_first_kept_and_stop_ends_it(
        make_project: Callable[[], Project], home: Path) -> None:
    project = kept_project(make_project, home)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stderr
    for noise in ("prefect", "Prefect", "Traceback"):  # the terminal shows nothing of the server
        assert noise not in first.stdout + first.stderr, noise
    kept = state(home)
    assert kept is not None and str(kept["url"]).startswith("http://127.0.0.1:")
    [server] = keepers(home)
    assert server.pid == kept["pid"]  # it outlived the run that started it

    again = project.conveyor("run", "-f", "-v")
    assert again.returncode == 0, again.stderr
    assert "said-one" in again.stdout + again.stderr  # -v shows a command's own output
    assert "View at" not in again.stderr and "/runs/flow-run/" not in again.stderr  # no UI to link to
    assert state(home) == kept and [p.pid for p in keepers(home)] == [server.pid]  # joined, none started
    records = sorted((project.root / ".conveyor/runs").glob("2*.json"))
    ids = {json.loads(r.read_text())["flow_run_id"] for r in records}
    assert len(ids) == 2 and ids <= set(flow_runs(str(kept["url"])))  # both runs landed in its API

    status = project.conveyor("server", "status")
    assert f"pid:           {server.pid}" in status.stdout and "runs using it: none" in status.stdout
    listed = project.conveyor("runs")
    assert f"Prefect server: kept at {kept['url']} (pid {server.pid}" in listed.stdout

    stopped = project.conveyor("server", "stop")
    assert stopped.returncode == 0 and f"pid {server.pid}" in stopped.stdout
    assert gone(server) and state(home) is None
    assert "no Prefect server kept" in project.conveyor("server", "status").stdout
    assert "Prefect server" not in project.conveyor("runs").stdout


def test_a_kept_server_stays_while_a_run_uses_it_and_goes_after_its_idle_time_when_that_run_is_killed(
        make_project: Callable[[], Project], home: Path) -> None:
    project = kept_project(make_project, home, idle="1")
    project.write("configs/pipeline.yaml", f"""
        pipeline: hold
        stages:
          hold: {{cmd: '{HOLD}', outs: [done.txt]}}
    """)
    run = project.popen("run")
    wait_until("the stage started", (project.root / "started").exists, run, timeout_s=180)
    assert run.poll() is None
    [server] = keepers(home)
    time.sleep(2.5)  # past its idle time: what keeps it is the run's lease (nothing to wait on but time)
    assert not gone(server)
    status = project.conveyor("server", "status")
    assert f"runs using it: 1 (pid {run.pid})" in status.stdout, status.stdout
    refused = project.conveyor("server", "stop")
    assert refused.returncode == 2 and f"in use by 1 run(s) (pid {run.pid})" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not gone(server)

    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=30)
    wait_until("the kept server stopping after its idle time", lambda: gone(server), timeout_s=60)
    assert state(home) is None and not list((home / "conveyor-server/leases").iterdir())
    assert "stops after 1 s unused" in (home / "conveyor-server/server.log").read_text()
    assert not project.left_running(grace_s=10)  # the stage's commands went with the run


def test_two_projects_running_at_once_start_one_server_and_both_land_in_it(
        make_project: Callable[[], Project], home: Path) -> None:
    wide = "\n".join(f"  s{k}: {{cmd: 'echo {k} > s{k}.txt', outs: [s{k}.txt]}}" for k in range(6))
    projects = [kept_project(make_project, home) for _ in range(2)]
    for project in projects:
        project.write("configs/pipeline.yaml", f"pipeline: wide\nstages:\n{wide}\n")
    runs = [project.popen("run") for project in projects]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    kept = state(home)
    assert kept is not None and len(keepers(home)) == 1
    landed = set(flow_runs(str(kept["url"])))
    for project in projects:
        record = project.record()
        assert record["status"] == "succeeded" and record["flow_run_id"] in landed
        assert {s["status"] for s in record["stages"].values()} == {"succeeded"}
    log = (home / "conveyor-server/server.log").read_text()
    assert "database is locked" not in log and "Traceback" not in log, log


def test_a_set_prefect_api_url_keeps_no_server(make_project: Callable[[], Project], home: Path) -> None:
    project = make_project()  # the session's server, by PREFECT_API_URL; a home of the test's own (no runner yet)
    project.env.update(PREFECT_HOME=str(home), CONVEYOR_SERVER_IDLE="60")
    project.env.pop("CONVEYOR_WARM_IDLE", None)  # the suite's (tests/conftest.py): runners idle as the server
    project.write("configs/pipeline.yaml", "pipeline: p\nstages:\n  one: {cmd: echo 1 > one.txt, outs: [one.txt]}\n")
    assert project.conveyor("run").returncode == 0
    assert not (home / "conveyor-server/server.json").exists() and not keepers(home)
    status = project.conveyor("server", "status")
    assert status.returncode == 0 and "PREFECT_API_URL is set" in status.stdout
    assert "warm runners:  1" in status.stdout  # what the next run is forked by: kept with a server set too
    assert "stopping 1 warm runner(s)" in project.conveyor("server", "stop").stdout


def test_a_bad_idle_time_is_one_line_and_exit_2(make_project: Callable[[], Project], home: Path) -> None:
    project = kept_project(make_project, home, idle="soon")
    done = project.conveyor("run")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("CONVEYOR_SERVER_IDLE='soon': give the seconds a kept Prefect server waits unused "
                                   "before it stops (0: a server per run)")
    assert not keepers(home)


def test_a_prefect_home_where_no_server_can_be_kept_fails_the_run_in_one_line(
        make_project: Callable[[], Project], tmp_path: Path) -> None:
    (tmp_path / "home").write_text("a file, where Prefect wants its home folder")
    project = kept_project(make_project, tmp_path / "home")
    done = project.conveyor("run")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"cannot keep a Prefect server in {tmp_path / 'home'}/conveyor-server" in done.stderr
    assert project.record()["status"] == "failed"
    assert not project.left_running(grace_s=5)



def test_a_kept_server_whose_prefect_home_was_removed_still_stops_after_its_idle_time(
        make_project: Callable[[], Project], tmp_path: Path) -> None:
    home = new_home(tmp_path / "removed-home")  # migrated already: what it checks is after the run
    project = kept_project(make_project, home, idle="2")
    assert project.conveyor("run").returncode == 0
    [server] = keepers(home)
    try:
        # a temporary PREFECT_HOME cleaned up, `rm -rf ~/.prefect`: nothing to read its state from. Again until
        # it stays removed: the home's processes (the kept server's keeper, the warm runner the run started)
        # may still write their state files there right after the run
        wait_until("the home removed", lambda: removed(home), timeout_s=30)
        wait_until("the server stopping after its idle time", lambda: gone(server), timeout_s=60)
    finally:
        if not gone(server):
            server.kill()
