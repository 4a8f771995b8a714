"""Process trees, their memory and their leftovers, through psutil (no /proc parsing of our own), and a
`prefect server start` for the benchmarks' runs (so that Prefect's start-up is not measured)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import psutil

from benchmarks.harness import check
from conveyor.cli.warm_state import Runner, runners

MIB = 2**20
GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def tree_rss(pid: int, *, root: bool = True) -> dict[int, int]:
    """Bytes of RSS of ``pid`` (unless ``root`` is false) and of each of its descendants now."""
    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)] if root else top.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    sizes: dict[int, int] = {}
    for proc in procs:
        with contextlib.suppress(*GONE):
            sizes[proc.pid] = proc.memory_info().rss
    return sizes


class Sampler:
    """``on_sample(tree_rss(pid))`` every ``period_s`` on a thread until closed, the largest sum in ``peak``;
    ``root=False`` leaves ``pid`` itself out (a timer such as hyperfine wrapping the measured command)."""

    def __init__(self, pid: int, period_s: float = 0.1, *, root: bool = True,
                 on_sample: Callable[[dict[int, int]], None] = lambda _sizes: None) -> None:
        self.pid, self.period_s, self.root, self.on_sample = pid, period_s, root, on_sample
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = tree_rss(self.pid, root=self.root)
            self.peak = max(self.peak, sum(sizes.values()))
            self.on_sample(sizes)
            self._stop.wait(self.period_s)


def stop_group(pgid: int, grace_s: float) -> bool:
    """Wait up to ``grace_s`` for process group ``pgid`` to be empty; SIGKILL what is left. True if any was."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return True
        time.sleep(0.2)


def with_prefect_home(home: Path) -> list[psutil.Process]:
    """Every process of this user whose environment has ``PREFECT_HOME=home`` (a run's own)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(*GONE, OSError):
            if proc.pid != os.getpid() and proc.environ().get("PREFECT_HOME") == str(home):
                found.append(proc)
    return found


def _kept(proc: psutil.Process) -> bool:
    """The kept Prefect server, or a warm runner (conveyor.cli.warm): meant to outlive the runs."""
    try:
        line = proc.cmdline()
    except GONE:
        return False
    return "conveyor.prefect.keeper" in line or any("conveyor.cli.warm_runner" in part for part in line)


def leftovers(home: Path, grace_s: float = 10) -> list[int]:
    """Pids with ``PREFECT_HOME=home`` still running ``grace_s`` after a run (killed); those kept on purpose (a
    server, warm runners) are ended, not reported."""
    procs = with_prefect_home(home)
    _gone, alive = psutil.wait_procs([p for p in procs if not _kept(p)], timeout=grace_s)
    for proc in [*alive, *filter(_kept, procs)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return [proc.pid for proc in alive]


def wait_warm(home: Path, deadline_s: float = 60) -> Runner:
    """The warm runner the first run of ``home`` started, once it serves (it writes its state file then)."""
    deadline = time.monotonic() + deadline_s
    while not (found := [r for r in runners(home) if r.served >= 0]):
        check(time.monotonic() < deadline, f"no warm runner served {deadline_s:.0f} s after the first run")
        time.sleep(0.05)
    return found[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrefectServer:
    """``with PrefectServer() as server: subprocess.run(..., env=server.env)``: a free loopback port, a temporary
    PREFECT_HOME, its own process group, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, startup_timeout_s: float = 180) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.home = Path(tempfile.mkdtemp(prefix="conveyor-bench-prefect-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment that points Prefect clients (``conveyor run``) at this server."""
        return {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def __enter__(self) -> PrefectServer:
        env = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"} | {"PREFECT_SERVER_UI_ENABLED": "false"}
        started = time.monotonic()
        log = self.home / "server.log"
        with log.open("wb") as out:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.startup_s = time.monotonic() - started
                        return self
                if time.monotonic() - started > self.startup_timeout_s:
                    raise RuntimeError(f"prefect server at {self.url} not healthy after {self.startup_timeout_s:.0f} s")
                time.sleep(0.25)
            said = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{said}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the server's process group (SIGTERM, SIGKILL after ``timeout_s``) and remove its PREFECT_HOME."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
            stop_group(proc.pid, grace_s=0)  # what is left of its group, SIGKILLed
            proc.wait()
        leftovers(self.home, grace_s=0)  # and what its runs kept: the warm runners (conveyor.cli.warm)
        shutil.rmtree(self.home, ignore_errors=True)
