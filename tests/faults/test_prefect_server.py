"""The Prefect server a run records in dies mid-run, is not there, or accepts and never answers.

Prefect only observes the run: a server that dies (SIGKILL, 2 s into a stage) must not cost
the stages their outcome, and the run must still end within seconds of its last stage, with
one line naming the server, a record that says the run failed because of it, and nothing left
running (Prefect's log and event workers would otherwise wait on the dead server at exit for
minutes). A server that is not there at the start, or one that accepts connections and never
answers, is said in one line within seconds, before any stage runs. Each server here is the
test's own (never the session's shared one): one it kills, a port nobody listens on, a socket
that never answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import psutil
import pytest
from httpfiles import serving
from prefect_homes import new_home
from projects import Project
from repos import dvc, git_dvc_init
from subprocs import cmdline, stop_group, wait_for

pytestmark = pytest.mark.slow

DVC_YAML = """
    stages:
      one:
        cmd: echo 1 > one.txt
        outs: [one.txt]
      slow:
        cmd: touch slow.started && sleep 4 && echo {token} > two.txt
        deps: [one.txt]
        outs: [two.txt]
      after:
        cmd: cat two.txt > three.txt
        deps: [two.txt]
        outs: [three.txt]
"""

LAST_STAGE_TO_EXIT_S = 20  # Prefect's client, bounded by conveyor, gives up on a dead server in seconds


def dvc_project(tmp_path: Path, home: Path) -> Project:
    """A DVC project (git + dvc init) of three chained command stages; no PREFECT_API_URL yet."""
    root = tmp_path / f"proj-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "CONVEYOR_TEST_TAG": tag, "COLUMNS": "200"})
    project = Project(root, env, tag)
    project.write("pyproject.toml", "[project]\nname = 'demo'\n")
    project.write("dvc.yaml", DVC_YAML.format(token=uuid.uuid4().hex))  # never in DVC's run cache
    git_dvc_init(root)
    return project


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, f"prefect server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            assert time.monotonic() < deadline, f"prefect server at {url} not healthy after {deadline_s}s"
            time.sleep(0.25)  # a server that is booting: nothing to wait on but the socket


@contextmanager
def own_prefect_server(home: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``prefect server start`` of this test alone (conftest's recipe): (API URL, process)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_UI_ENABLED": "false"})
    with (home / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}/api"
        try:
            wait_healthy(url, proc)
            yield url, proc
        finally:
            stop_group(proc, timeout=30)


@contextmanager
def never_answering() -> Iterator[str]:
    """A loopback socket that accepts connections and never says a word: its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    closed = threading.Event()

    def accept() -> None:
        while not closed.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed at the end of the test
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/api"
    finally:
        closed.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for conn in held:
            conn.close()
        thread.join(timeout=5)


def temporary_server(proc: subprocess.Popen[str]) -> psutil.Process:
    """The temporary Prefect server the run ``proc`` started (its uvicorn child)."""
    servers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "uvicorn" in " ".join(cmdline(c))]
    assert len(servers) == 1, servers
    return servers[0]


def finished_at(record: dict[str, object], stage: str) -> float:
    stages = record["stages"]
    assert isinstance(stages, dict)
    return datetime.fromisoformat(stages[stage]["finished"]).timestamp()


def assert_one_line(out: str, url: str, words: str) -> None:
    assert "Traceback" not in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert url in last and words in last, out[-4000:]
    assert sum(url in line for line in out.splitlines()) == 1, out[-4000:]


def dvc_up_to_date(project: Project) -> bool:
    status = dvc(project.root, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    return "up to date" in status.stdout


@pytest.mark.parametrize("server", ["configured", "temporary"])
def test_a_server_killed_mid_run_costs_no_stage_and_the_run_ends_within_seconds(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, server: str) -> None:
    home = new_home(tmp_path_factory.mktemp("prefect-home"))
    project = dvc_project(tmp_path, home)
    with own_prefect_server(home) if server == "configured" else _no_server() as (url, own):
        if own is not None:
            project.env["PREFECT_API_URL"] = url
        proc = project.popen("run")
        wait_for(project.root / "slow.started", proc, 240)
        if own is not None:  # SIGKILL, 'slow' still running
            os.killpg(own.pid, signal.SIGKILL)
        else:  # the URL the run uses: its temporary server's port
            dying = temporary_server(proc)
            url = f"http://127.0.0.1:{dying.cmdline()[dying.cmdline().index('--port') + 1]}/api"
            dying.kill()
        out, _ = proc.communicate(timeout=300)
        ended = time.time()

    assert proc.returncode == 1, out[-4000:]
    assert_one_line(out, url, "stopped answering")
    record = json.loads((project.root / ".conveyor/runs/latest.json").read_text())
    assert {n: s["status"] for n, s in record["stages"].items()} == {
        "one": "succeeded", "slow": "succeeded", "after": "succeeded"}, record
    assert record["status"] == "failed" and url in record["reason"] and "stopped answering" in record["reason"]
    took = ended - finished_at(record, "after")
    assert took < LAST_STAGE_TO_EXIT_S, f"the run ended {took:.0f}s after its last stage"
    assert (project.root / "three.txt").read_text() == (project.root / "two.txt").read_text()
    assert dvc_up_to_date(project)  # every stage recorded in dvc.lock
    assert not project.left_running(grace_s=5), "a process outlived the run"


@contextmanager
def _no_server() -> Iterator[tuple[str, subprocess.Popen[bytes] | None]]:
    """No server of the test's own: the run starts its temporary one."""
    yield "", None


@pytest.mark.parametrize("server", ["refused", "silent", "not-prefect"])
def test_a_server_that_does_not_answer_at_the_start_is_said_in_one_line_within_seconds(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, server: str) -> None:
    project = dvc_project(tmp_path, new_home(tmp_path_factory.mktemp("prefect-home")))
    answering = {"silent": never_answering, "refused": _nobody_listening, "not-prefect": _not_prefect}[server]
    with answering() as url:
        t0 = time.monotonic()
        done = project.conveyor("run", env={"PREFECT_API_URL": url}, timeout=300)
        took = time.monotonic() - t0

    assert done.returncode == 1, done.stdout + done.stderr
    assert_one_line(done.stdout + done.stderr, url, "does not answer")
    if server == "not-prefect":  # another service, or a URL without its /api: said, not Prefect's traceback
        assert "HTTP 404 at /health: no Prefect API there" in done.stderr, done.stderr
    assert took < 30, f"the run took {took:.0f}s to say its server does not answer"
    record = json.loads((project.root / ".conveyor/runs/latest.json").read_text())
    assert record["status"] == "failed" and url in record["reason"], record
    assert {s["status"] for s in record["stages"].values()} == {"not_run"}
    assert not (project.root / "dvc.lock").exists() and not (project.root / "one.txt").exists()
    assert not project.left_running(), "a process outlived the run"



def test_an_api_that_asks_for_credentials_is_said_in_one_line(tmp_path_factory: pytest.TempPathFactory,
                                                               tmp_path: Path) -> None:
    """As a server started with PREFECT_SERVER_API_AUTH_STRING does: /health to anyone, 401 to the rest
    without its credentials. One line saying what to set (it was Prefect's traceback), nothing run."""
    project = dvc_project(tmp_path, new_home(tmp_path_factory.mktemp("prefect-home")))
    with _serving(_AsksCredentials) as url:
        done = project.conveyor("run", env={"PREFECT_API_URL": url}, timeout=300)

    assert done.returncode == 1, done.stdout + done.stderr
    assert_one_line(done.stdout + done.stderr, url, "refuses conveyor's requests (HTTP 401 Unauthorized)")
    assert "PREFECT_API_AUTH_STRING" in done.stderr
    record = json.loads((project.root / ".conveyor/runs/latest.json").read_text())
    assert record["status"] == "failed" and {s["status"] for s in record["stages"].values()} == {"not_run"}
    assert not (project.root / "one.txt").exists()
    assert not project.left_running(), "a process outlived the run"

def _not_prefect() -> AbstractContextManager[str]:
    """A loopback HTTP server that answers every request with 404, as a service that is not Prefect's does."""
    return _serving(_NotFound)


@contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A loopback HTTP server of ``handler`` for the block; the API URL it would have."""
    with serving(handler) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/api"


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    do_POST = do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


class _AsksCredentials(_NotFound):
    def do_GET(self) -> None:
        self.send_response(200 if self.path.endswith("/health") else 401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"true" if self.path.endswith("/health") else b'{"exception_message": "Unauthorized"}')

    do_POST = do_PATCH = do_HEAD = do_GET


@contextmanager
def _nobody_listening() -> Iterator[str]:
    """A loopback port held (bound, never listening: a connection is refused) for the block: a free port
    let go at once could be taken meanwhile by another test's server, which answers (a Dask
    dashboard's /health did, once the run waited for its warm runner's imports)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}/api"
