"""Shared fixtures: one Prefect server for the whole test session, and small projects on disk.

Starting Prefect's server costs seconds (SQLite migrations), so every test that runs a
flow shares this one, on a free loopback port with a temporary PREFECT_HOME.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import psutil
import pytest
from prefect_homes import migrate_template, new_home
from projects import first_run  # noqa: F401  # a fixture: tests/test_docs.py's and tests/e2e/'s
from subprocs import FAILED, is_warm_runner, stop_group

# A run without PREFECT_API_URL keeps a Prefect server for the runs after it (conveyor.prefect.kept).
# In the tests that take PREFECT_API_URL away, the server is the run's own (it ends with the run)
# unless the test asks for a kept one (tests/e2e/test_kept_server.py) and stops it: no test leaves
# a server behind for its idle time.
os.environ.setdefault("CONVEYOR_SERVER_IDLE", "0")
# The runs themselves are forked by a warm runner (conveyor.cli.warm), as a user's are: one per
# test process and environment, shared by the tests (each test's tag and pytest's own variable
# left out of its key), ended when the test process ends (_warm_runners_end) and after 2 min unused
# (the runner of a test's own PREFECT_HOME, not the session's, serves that test alone). A test
# process's runs would otherwise spend 1.1 of their 1.6 CPU-seconds importing Prefect & co.
os.environ.setdefault("CONVEYOR_WARM_IDLE", "120")
os.environ["CONVEYOR_WARM_IGNORE"] = "CONVEYOR_TEST_TAG,PYTEST_CURRENT_TEST"
# This test process's runners, found by it at its end (and by no other test run's)
os.environ["CONVEYOR_TESTS_SESSION"] = uuid.uuid4().hex
# Nor does a test read the user's own PREFECT_HOME: a server kept there by the user's own
# `conveyor run` (the README's first command) would show in `conveyor runs` and the like.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="conveyor-tests-prefect-home-")
# Nor the user's cache of loaded projects (conveyor.spec.snapshot): the session's own.
os.environ["CONVEYOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="conveyor-tests-cache-")
# Both removed as this process ends (pytest_unconfigure), its runners gone by then (_warm_runners_end)
_MADE_HERE = (os.environ["PREFECT_HOME"], os.environ["CONVEYOR_CACHE_DIR"])
# No `dvc` the tests run sends DVC's usage report (a daemon that posts it to
# analytics.dvc.org after the command; where the network is closed it left the report in /tmp):
# all the suite's traffic stays on 127.0.0.1, whatever the projects' own DVC config says.
os.environ["DVC_NO_ANALYTICS"] = "1"
# The processes the tests start (conveyor, Dask workers, isolated tasks) write their bytecode as
# a user's Python does: a machine with PYTHONDONTWRITEBYTECODE set (CI's) would otherwise have
# every one of them compile conveyor's modules anew (0.1 s of each `conveyor status`).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Every Dask process of the suite (the clusters of its runs, its fixtures' clusters, `dask worker`s)
# idles without Dask's statistical profiler (a sample of every thread each 10 ms) and with its
# event-loop watchdog ticking each second instead of each 20 ms: an idle 2-worker LocalCluster took
# 10 % of a core (its scheduler 3.8 %, each worker 3.2 %), 2.5 % with these; the tasks' session
# cluster idles for the whole session. Neither setting changes what a task computes or when.
# And OpenMP's threads (GNU OpenMP: PyTorch's, XGBoost's, scikit-learn's) sleep as soon as they
# wait instead of spinning first: the suite runs two test processes per core, and a thread that
# spins while the one it waits for is off the CPU burns that CPU for nothing (measured beside
# busy processes on 2 cores: an XGBoost fit of 500 rows took 3.35 CPU-s instead of 0.22, passive
# 0.31; tests/tasks/test_mlp_checkpoints.py 22 CPU-s, 7.6 passive; the `-m "not slow"` run 303
# CPU-s, 250). Read as the library loads: set before any test process or `conveyor` imports one.
# Not conveyor's default: alone on its cores a spinning thread is faster (docs/benchmarks.md, "Stages at once").
for _name, _value in (("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False"),
                      ("DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL", "1s"),
                      ("OMP_WAIT_POLICY", "PASSIVE")):
    os.environ.setdefault(_name, _value)
if "dask" in sys.modules:  # imported before this file by a plugin: read the environment again
    import dask.config

    dask.config.refresh()


_TEMPLATE = pytest.StashKey[tuple[Path, "subprocess.Popen[bytes]"] | None]()


def pytest_configure(config: pytest.Config) -> None:
    """Once per test run (in xdist's controller, before its test processes start, or in the one
    process of ``-n0``): one Prefect database migrated in the background, which each test process's
    server and the tests' own Prefect homes start from (tests/prefect_homes.py)."""
    if not hasattr(config, "workerinput"):
        config.stash[_TEMPLATE] = migrate_template()


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_TEMPLATE, None)
    if made is not None:
        home, migrating = made
        migrating.kill()  # long done, unless no test waited for it
        migrating.wait()
        shutil.rmtree(home, ignore_errors=True)
    for folder in _MADE_HERE:  # every test process (and xdist's controller) made its own
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _prefect_home_migrated() -> None:
    """This process's own PREFECT_HOME (above) starts from the migrated database too, for the tests
    whose runs start conveyor's own server there."""
    new_home(Path(_SESSION_ENVIRON["PREFECT_HOME"]))


@pytest.fixture(scope="session", autouse=True)
def _warm_runners_end() -> Iterator[None]:
    """The warm runners this test process's runs started (whatever their PREFECT_HOME) end with it:
    SIGTERM (a runner ends once its runs have), then SIGKILL for any still there after 30 s."""
    yield
    mine = []
    for proc in psutil.process_iter():
        try:
            if is_warm_runner(proc) and \
                    proc.environ().get("CONVEYOR_TESTS_SESSION") == os.environ["CONVEYOR_TESTS_SESSION"]:
                proc.terminate()
                mine.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    _, alive = psutil.wait_procs(mine, timeout=30)
    for proc in alive:
        proc.kill()


# The PREFECT_HOMEs of the whole session (this process's own, the session server's): their warm
# runners serve every test's runs. Any other home is a test's own (made by that test).
_SESSION_HOMES = {os.environ["PREFECT_HOME"]}


@pytest.fixture(autouse=True)
def _own_runners_end() -> Iterator[None]:
    """The warm runners a test's runs started in a PREFECT_HOME of the test's own serve that test
    alone: they end with it (SIGTERM), not 2 min later. A runner imports Prefect & co. once its
    first run has ended (1.3 CPU-s); most of these never served a run (53 of a suite's 77 runners),
    and one stopped while it waits or imports ends at once. Not waited for: _warm_runners_end
    finds any still there."""
    started = time.time() - 1  # create_time is rounded
    yield
    for proc in psutil.process_iter():
        try:
            if proc.create_time() < started or not is_warm_runner(proc):
                continue
            parent = proc.parent()
            if parent is not None and is_warm_runner(parent):  # a run it forked: it ends with its runner
                continue
            environ = proc.environ()
            if environ.get("CONVEYOR_TESTS_SESSION") == os.environ["CONVEYOR_TESTS_SESSION"] \
                    and environ.get("PREFECT_HOME") not in _SESSION_HOMES:
                proc.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                               call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed phase marks its test (:data:`subprocs.FAILED`) for the fixtures' teardowns."""
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes per core. Much of the suite waits (on servers starting, a
    cluster losing its workers, Slurm's scheduler, a killed run's processes going), and a waiting
    test leaves its core to the other: on 2 cores, 4 processes ran the suite in 16:52, 2 in 20:20.
    Not more than one per 2 GiB of available memory beyond one per core (each holds a Prefect
    server and, in its tests, clusters and pipelines)."""
    import psutil

    cores = len(os.sched_getaffinity(0))
    memory_bound = int(psutil.virtual_memory().available) // 2**31
    return min(2 * cores, max(cores, memory_bound))


# os.environ as the session began (after the settings above): what every test starts from
_SESSION_ENVIRON = dict(os.environ)


@pytest.fixture(autouse=True)
def _environ_as_the_session_had_it() -> Iterator[None]:
    """Each test starts and ends with Dask's nanny variables as the session began, and ends with
    the rest of ``os.environ`` as it began: a Dask nanny in the tests' process (a cluster fixture
    of any scope) writes ``OMP_NUM_THREADS=1`` and the like into ``os.environ`` before it spawns a
    worker (Dask's pre-spawn-environ) and never takes them back, and a project's environment is a
    copy of ``os.environ``: a later test's ``conveyor`` ran with them (in whatever order xdist
    deals the tests). The workers already spawned keep theirs."""
    _nanny_variables_as_the_session_began()
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)
    _nanny_variables_as_the_session_began()


def _nanny_variables_as_the_session_began() -> None:
    if "dask" not in sys.modules:  # no cluster in this process yet
        return
    import dask.config

    for name in dask.config.get("distributed.nanny.pre-spawn-environ", default=None) or {}:
        if name in _SESSION_ENVIRON:
            os.environ[name] = _SESSION_ENVIRON[name]
        else:
            os.environ.pop(name, None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.25)  # a server that is booting: nothing to wait on but the socket
    raise RuntimeError(f"prefect server at {url} not healthy after {deadline_s}s")


# The server's loops that nothing in the suite waits on, off: each wakes every 5 to 20 s (an idle
# server with them took 2.5 % of a core, 1.5 % without, one server per test process for the whole
# session). And the event persister, which writes every event to the database for the UI's event
# feed, which no test reads: a fifth of the server's CPU per run (3.8 -> 3.0 CPU-s per 20 forced
# two-stage runs). Kept: the scheduler (deployments' schedules), the task-run recorder (task runs
# are made from their events) and triggers.
_IDLE_SERVICES_OFF = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "LATE_RUNS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR", "FOREMAN", "CLEANUP_RECONCILER",
    "EVENT_PERSISTER")}


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server start` on 127.0.0.1; yields the env that points clients at it."""
    home = new_home(tmp_path_factory.mktemp("prefect-home"))
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_API_URL": "", **_IDLE_SERVICES_OFF}
    env.pop("PREFECT_API_URL")
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    _SESSION_HOMES.add(str(home))
    try:
        _wait_healthy(url, proc, 120)
        yield {"PREFECT_HOME": str(home), "PREFECT_API_URL": url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    finally:
        stop_group(proc, timeout=30)
        log.close()


REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- a small project on disk

STEPS = '''\
"""Stage bodies of the test project."""

from tasks.helpers import scale


def fetch(ctx):
    return None


def prepare(ctx):
    return scale(1)


def train(ctx):
    return None


def stack(ctx):
    return None
'''

HELPERS = '''\
def scale(x):
    return x * 2
'''

UNRELATED = '''\
def unused():
    return 0
'''

PARAMS = '''\
ingest:
  shards: 4
  url: https://example.org/data.csv
preprocess:
  test_size: 0.2
train:
  xgb:
    max_depth: 3
    eta: 0.1
  mlp:
    hidden: 16
'''

GOOD_SPEC = '''\
pipeline: demo
profiles:
  io: {kind: threads, max_workers: 4}
  cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
  gpu: {kind: dask-cuda, fallback: cpu}
stages:
  ingest:
    task: tasks.steps:fetch
    on: io
    params: [ingest]
    outs: [data/raw]
  prepare:
    task: tasks.steps:prepare
    on: cpu
    deps: [data/raw]
    params: [preprocess]
    outs: [data/processed]
'''


class ProjectDir:
    """A conveyor project on disk; ``spec(text)`` writes configs/pipeline.yaml."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.write("pyproject.toml", '[project]\nname = "demo"\nversion = "0"\n')
        self.write("tasks/__init__.py", "")
        self.write("tasks/steps.py", STEPS)
        self.write("tasks/helpers.py", HELPERS)
        self.write("tasks/unrelated.py", UNRELATED)
        self.write("params.yaml", PARAMS)

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    def good_spec(self) -> Path:
        """A valid spec: ingest (threads) feeds prepare (dask); a gpu profile falls back to cpu."""
        return self.spec(GOOD_SPEC)

    def spec(self, text: str, rel: str = "configs/pipeline.yaml") -> Path:
        """Write a spec (dedented) and return its absolute path."""
        return self.write(rel, textwrap.dedent(text).lstrip("\n"))


@pytest.fixture
def project(tmp_path: Path) -> ProjectDir:
    return ProjectDir(tmp_path.resolve())


@pytest.fixture
def forget_packages() -> Iterator[set[str]]:
    """Packages a test imports from its own throwaway dirs; dropped from sys.modules afterwards."""
    names: set[str] = set()
    yield names
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]
