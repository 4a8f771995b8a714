"""Stages on a Dask cluster that does not see the project's disk: a scheduler and a worker started
here in mount namespaces of their own (``unshare -m``) where the project's directory is an empty
tmpfs; what they share with the runner is a local-directory DVC remote, and only when the project
has one. The pipeline::

    source (a local task) ──► double (a cmd on the cluster) ──► square (a task on the cluster)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from distributed import Client
from distributed.utils import open_port
from projects import HALVES, Project, assert_ran_on_remote
from repos import ANALYTICS_OFF, git_dvc_init
from subprocs import stop_group

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) for mount namespaces")

TASKS = '''
import json
import time


def source(ctx):
    ctx.out().write_text(f"{ctx.params['source']['value']}\\n")


def square(ctx):
    value = int(ctx.dep("data/double.txt").read_text())
    squared = ctx.client.submit(pow, value, 2, pure=False).result()   # work on the cluster itself
    (ctx.out("data/square") / "nested").mkdir(parents=True)
    (ctx.out("data/square") / "nested/value.txt").write_text(f"{squared}\\n")
    ctx.metric().write_text(json.dumps({"square": squared, "root_seen": str(ctx.root)}))
    ctx.log.info("squared %d on the cluster", value)
    if ctx.params["square"]["hang"]:
        ctx.log.info("hanging")
        while True:
            time.sleep(0.05)
'''

SCRIPT = '''
import sys
import time
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.parent.mkdir(parents=True, exist_ok=True)
dst.write_text(f"{int(src.read_text()) * 2}\\n")
print(f"doubled in {Path.cwd()}", flush=True)
if sys.argv[3] == "1":
    print("hanging", flush=True)
    time.sleep(600)
if sys.argv[3] == "2":
    print("double: bad input, giving up", file=sys.stderr)
    sys.exit(3)
'''

SPEC = """
pipeline: unshared
profiles:
  remote: {kind: dask, address: "ADDRESS"}
stages:
  source: {task: tasks.steps:source, params: [source], outs: [data/source.txt]}
  double:
    cmd: python scripts/double.py data/source.txt data/double.txt ${double.hang}
    on: remote
    params: [double]
    deps: [data/source.txt, scripts/double.py]
    outs: [data/double.txt]
  square:
    task: tasks.steps:square
    on: remote
    params: [square]
    deps: [data/double.txt]
    outs: [data/square]
    metrics: [metrics/square.json]
"""

PARAMS = "source: {{value: {value}}}\ndouble: {{hang: {double}}}\nsquare: {{hang: {square}}}\n"
CLUSTER_TAG = "CONVEYOR_TEST_CLUSTER"  # in the environment of a cluster's processes and what they start


def _hidden(root: Path, argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own where ``root`` is an empty tmpfs."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{root}" && exec "$@"', "hidden", *argv]


@contextmanager
def _blind(root: Path, elsewhere: Path, workers: int, nthreads: int, *, hidden: bool = True) -> Iterator[str]:
    """A scheduler and ``workers`` workers, each in a mount namespace of its own where ``root`` is an
    empty folder (unless not ``hidden``: then they share the disk), with no PYTHONPATH; their
    address. Stopped at the end."""
    port = open_port("127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env[CLUSTER_TAG] = address  # inherited by what the workers start: this cluster's, not another test's
    argvs = [["dask", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", "127.0.0.1:0"]]
    argvs += [["dask", "worker", address, "--nthreads", str(nthreads), "--memory-limit", "2GiB", "--host",
               "127.0.0.1", "--dashboard-address", "127.0.0.1:0", "--name", f"blind{i}"] for i in range(workers)]
    procs = [subprocess.Popen(_hidden(root, argv) if hidden else argv, cwd=elsewhere, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for argv in argvs]
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(workers, timeout=120)
            if hidden:
                assert set(map(tuple, client.run(os.listdir, str(root)).values())) == {()}  # an empty folder there
        yield address
    finally:
        for proc in reversed(procs):  # workers first, then the scheduler
            stop_group(proc)


@pytest.fixture
def blind_cluster(make_project: Callable[[], Project], tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[tuple[Project, str]]:
    """A project, and a scheduler and one worker that see an empty folder at its root."""
    project = make_project()
    with _blind(project.root, tmp_path_factory.mktemp("cluster"), 1, 2) as address:
        yield project, address


def _write(project: Project, address: str) -> None:
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("scripts/double.py", SCRIPT)
    project.write("params.yaml", PARAMS.format(value=21, double=0, square=0))
    project.write("configs/pipeline.yaml", SPEC.replace("ADDRESS", address))


def _with_remote(project: Project, store: Path) -> None:
    """Make the project a git + DVC repository whose default remote is the folder ``store``, its spec
    compiled to dvc.yaml."""
    project.write(".gitignore", "/.conveyor/\n__pycache__/\n")
    git_dvc_init(project.root, ANALYTICS_OFF)
    for argv in (["git", "config", "user.email", "t@example.com"], ["git", "config", "user.name", "t"],
                 ["dvc", "remote", "add", "-d", "store", str(store)]):
        project.sh(*argv)
    assert project.conveyor("compile").returncode == 0  # dvc.yaml: DVC's dvc.lock and cache are the record


def _wait_for_line(project: Project, stage: str, text: str, proc: subprocess.Popen[str]) -> None:
    """Until the stage's log (of the run ``proc``) has ``text``: its lines come from the worker."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(text in log.read_text() for log in (project.root / ".conveyor/logs").glob(f"*/{stage}.log")):
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError(f"{stage} never logged {text!r}")


def _nothing_left(address: str) -> None:
    """Within a few seconds, no scratch directory on the worker and no process of the command."""
    deadline = time.monotonic() + 20
    with Client(address) as client:
        while (left := _scratch_left(client) + _commands(address, "scripts/double.py")) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert left == []


def _commands(address: str, text: str) -> list[str]:
    """The command lines holding ``text`` of the processes the cluster at ``address`` started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        try:
            if text in line and proc.environ().get(CLUSTER_TAG) == address:
                found.append(line)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _scratch_left(client: Client) -> list[str]:
    """The scratch directories on the worker (in its own directory, or the temporary directory)."""
    import tempfile

    def listing(dask_worker: Any) -> list[str]:
        places = [dask_worker.local_directory, tempfile.gettempdir()]
        return [n for place in places for n in os.listdir(place) if n.startswith("conveyor-scratch-")]

    return [name for names in client.run(listing).values() for name in names]


@pytest.mark.slow
def test_without_a_shared_disk_or_a_remote_the_run_stops_at_once_saying_what_to_configure(
        blind_cluster: tuple[Project, str]) -> None:
    project, address = blind_cluster
    _write(project, address)
    run = project.conveyor("run")
    assert run.returncode == 1, run.stdout + run.stderr
    said = " ".join((run.stdout + run.stderr).split())
    assert "Traceback" not in said, said
    assert ("double failed: NoSharedDisk: the Dask workers of profile 'remote' do not see the project's "
            f"directory {project.root}: give them a shared disk mounted at that path, or a DVC remote for the data "
            "to move through (dvc remote add -d NAME URL, a path or bucket both sides reach)") in said, said
    assert not (project.root / "data/double.txt").exists()
    assert not list((project.root / ".conveyor").glob("probe-*"))  # the marker is gone
    assert not project.left_running()


@pytest.mark.slow
def test_stages_move_their_data_through_the_dvc_remote(blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _write(project, address)
    _with_remote(project, tmp_path / "store")

    run = project.conveyor("run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (project.root / "data/double.txt").read_text() == "42\n"
    assert (project.root / "data/square/nested/value.txt").read_text() == "1764\n"
    metrics = json.loads((project.root / "metrics/square.json").read_text())
    assert metrics["square"] == 1764 and metrics["root_seen"] != str(project.root)  # it ran elsewhere
    stages = project.record()["stages"]
    assert {n: s["profile"] for n, s in stages.items()} == {"source": "local", "double": "remote", "square": "remote"}
    logs = project.root / ".conveyor/logs" / project.record()["run_id"]
    assert "doubled in" in (logs / "double.log").read_text()
    assert "squared 42 on the cluster" in (logs / "square.log").read_text()
    assert "deps stored in DVC remote 'store'" in (logs / "square.log").read_text()

    # recorded as a local run records: dvc.lock and the cache agree with the workspace
    assert json.loads(project.sh("dvc", "status", "--json").stdout) == {}
    locked = yaml.safe_load((project.root / "dvc.lock").read_text())["stages"]
    assert set(locked) == {"source", "double", "square"}
    digest = hashlib.md5(b"42\n").hexdigest()
    assert locked["double"]["outs"] == [{"path": "data/double.txt", "hash": "md5", "md5": digest, "size": 3}]
    assert (project.root / ".dvc/cache/files/md5" / digest[:2] / digest[2:]).read_text() == "42\n"
    with Client(address) as client:
        assert _scratch_left(client) == []  # nothing stays on the worker
    assert not project.left_running()

    # a fresh clone gets the outs from the remote
    project.sh("dvc", "push", "-q")
    project.sh("git", "add", "-A")
    project.sh("git", "commit", "-qm", "run")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project.root), str(clone)], check=True)
    pulled = subprocess.run(["dvc", "pull", "-q"], cwd=clone, env=project.env, capture_output=True, text=True)
    assert pulled.returncode == 0, pulled.stderr
    assert (clone / "data/square/nested/value.txt").read_text() == "1764\n"

    again = project.conveyor("run")  # nothing is stale: nothing moves
    assert again.returncode == 0, again.stderr
    assert {s["status"] for s in project.record()["stages"].values()} == {"skipped"}


@pytest.mark.slow
def test_kill_9_of_the_runner_stops_the_command_on_the_worker_and_keeps_the_previous_outs(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _write(project, address)
    _with_remote(project, tmp_path / "store")
    _killed_mid_command(project, address)

    project.write("params.yaml", PARAMS.format(value=5, double=0, square=0))
    run = project.conveyor("run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (project.root / "data/square/nested/value.txt").read_text() == "100\n"
    assert json.loads(project.sh("dvc", "status", "--json").stdout) == {}
    _nothing_left(address)


@pytest.mark.slow
def test_kill_9_of_the_runner_stops_the_command_on_a_worker_that_shares_the_disk(
        make_project: Callable[[], Project], tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same on an existing cluster that sees the project: Dask lets a task go on when its client
    is gone, so without conveyor's watch on the worker the command would outlive the run."""
    project = make_project()
    with _blind(project.root, tmp_path_factory.mktemp("cluster"), 1, 2, hidden=False) as address:
        _write(project, address)
        _killed_mid_command(project, address)


def _killed_mid_command(project: Project, address: str) -> None:
    """A run killed -9 while ``double``'s command hangs on the worker: within seconds nothing of it
    is left there, and the next command (status) puts double's previous outs back."""
    assert project.conveyor("run").returncode == 0
    project.write("params.yaml", PARAMS.format(value=5, double=1, square=0))
    proc = project.popen("run")
    try:
        _wait_for_line(project, "double", "hanging", proc)
    finally:
        proc.kill()
        proc.communicate()
    _nothing_left(address)
    assert project.conveyor("status").returncode == 0  # settles the killed run
    assert (project.root / "data/double.txt").read_text() == "42\n"


@pytest.mark.slow
def test_a_command_failing_on_the_worker_keeps_the_previous_outs_and_sends_nothing_back(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _write(project, address)
    _with_remote(project, tmp_path / "store")
    assert project.conveyor("run").returncode == 0
    project.write("params.yaml", PARAMS.format(value=5, double=2, square=0))
    run = project.conveyor("run")
    said = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1, said
    assert "stage 'double' failed: command exited with status 3; last lines of stderr: double: bad input" in said
    assert (project.root / "data/double.txt").read_text() == "42\n"
    assert json.loads(project.sh("dvc", "status", "--json").stdout).keys() == {"double"}  # its params changed
    _nothing_left(address)


@pytest.mark.slow
def test_ctrl_c_stops_the_task_on_the_worker_and_keeps_the_previous_outs(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _write(project, address)
    _with_remote(project, tmp_path / "store")
    assert project.conveyor("run").returncode == 0
    project.write("params.yaml", PARAMS.format(value=21, double=0, square=1))
    proc = project.popen("run")
    try:
        _wait_for_line(project, "square", "hanging", proc)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted (SIGINT): stopped square" in " ".join(out.split())
    assert (project.root / "data/square/nested/value.txt").read_text() == "1764\n"
    _nothing_left(address)
    assert not project.left_running()
    with Client(address) as client:  # the worker's thread is free again: a new task runs at once
        assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3


@pytest.mark.slow
def test_reference_pipeline_on_a_cluster_without_the_projects_disk(
        reference_project: Project, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The reference pipeline, its dask profiles pointed at two workers that see an empty folder at the
    project's root, sharing a local-directory DVC remote: the same metrics as on a shared disk."""
    project = reference_project
    _with_remote(project, tmp_path_factory.mktemp("store"))
    with _blind(project.root, tmp_path_factory.mktemp("cluster"), 2, 1) as address:
        spec = project.root / "configs/pipeline.yaml"
        spec.write_text(spec.read_text().replace(
            '  # remote: {kind: dask, address: "tcp://scheduler:8786"}   # an existing Dask cluster',
            f'  remote: {{kind: dask, address: "{address}"}}'))
        with Client(address) as client:
            before = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
        run = project.conveyor("run", "--profile", "cpu=remote", "--profile", "gpu=remote")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert_ran_on_remote(project)
        logs = project.root / ".conveyor/logs" / project.record()["run_id"]
        for stage in ("preprocess", "train_xgb"):  # the data moved through the remote
            assert "deps checked out into" in (logs / f"{stage}.log").read_text()
        assert json.loads(project.sh("dvc", "status", "--json").stdout) == {}
        with Client(address) as client:
            after = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
            assert after - before > 100
            assert _scratch_left(client) == []
    assert not project.left_running()



def _halves(project: Project, address: str, tmp_path: Path, script: str) -> None:
    """A git + DVC project of one cmd stage, ``script``, on the cluster at ``address``."""
    project.write("halves.sh", script)
    project.write("configs/pipeline.yaml", f"pipeline: halves\nprofiles:\n  remote: {{kind: dask, address: "
                  f"'{address}'}}\nstages:\n  halves: {{cmd: sh halves.sh, on: remote, deps: [halves.sh], "
                  "outs: [out.txt]}\n")
    _with_remote(project, tmp_path / "store")


@pytest.mark.slow
def test_a_checkpoint_saved_on_the_worker_comes_back_and_the_next_run_resumes_from_it(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _halves(project, address, tmp_path, HALVES)
    first = project.conveyor("run")
    assert first.returncode == 1, first.stdout + first.stderr
    (saved,) = (project.root / ".conveyor/checkpoints/halves").iterdir()  # fetched through the remote
    assert (saved / "first-half").read_text() == "first\n"
    log = (project.root / f".conveyor/logs/{project.record()['run_id']}/halves.log").read_text()
    assert "checkpoint at half 1 of 2 fetched from the worker through the remote" in log, log
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "halves resumes from half 1 of 2 (checkpoint of run " in again.stderr, again.stderr
    assert (project.root / "out.txt").read_text() == "first\nsecond\n"
    assert not (project.root / ".conveyor/checkpoints/halves").exists()
    _nothing_left(address)


@pytest.mark.slow
def test_kill_9_of_the_runner_keeps_the_checkpoint_the_worker_sent_and_the_next_run_resumes(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    _halves(project, address, tmp_path, HALVES.replace("echo stopped half-way >&2\nexit 3", "echo saved\nsleep 600"))
    proc = project.popen("run")
    try:
        _wait_for_line(project, "halves", "checkpoint at half 1 of 2 fetched from the worker", proc)
    finally:
        proc.kill()
        proc.communicate()
    _nothing_left(address)
    deadline = time.monotonic() + 20  # the command on the worker was stopped with the run
    while _commands(address, "sleep 600"):  # this cluster's: other tests' commands sleep 600 s too
        assert time.monotonic() < deadline, "the command outlived the killed run"
        time.sleep(0.2)
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "halves resumes from half 1 of 2 (checkpoint of run " in again.stderr, again.stderr
    assert (project.root / "out.txt").read_text() == "first\nsecond\n"


HALVES_TASK = '''
from conveyor.run.checkpoints import current


def halves(ctx):
    saved = ctx.checkpoint_dir / "first-half"
    if saved.exists():
        ctx.out().write_text(saved.read_text() + "second\\n")
        return
    saved.write_text("first\\n")
    current().mark(1, 2, "half")
    raise RuntimeError("stopped half-way")  # at once: the save goes back with the failure
'''


@pytest.mark.slow
def test_a_task_failing_on_the_worker_right_after_a_save_sends_it_back(
        blind_cluster: tuple[Project, str], tmp_path: Path) -> None:
    project, address = blind_cluster
    project.write("tasks/__init__.py", "")
    project.write("tasks/halves.py", HALVES_TASK)
    project.write("configs/pipeline.yaml", f"pipeline: halves\nprofiles:\n  remote: {{kind: dask, address: "
                  f"'{address}'}}\nstages:\n  halves: {{task: tasks.halves:halves, on: remote, outs: [out.txt]}}\n")
    _with_remote(project, tmp_path / "store")
    first = project.conveyor("run")
    assert first.returncode == 1 and "stopped half-way" in first.stdout + first.stderr, first.stdout + first.stderr
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "halves resumes from half 1 of 2 (checkpoint of run " in again.stderr, again.stderr
    assert (project.root / "out.txt").read_text() == "first\nsecond\n"
    _nothing_left(address)
