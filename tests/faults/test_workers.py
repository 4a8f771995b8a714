"""Dying Dask workers: killed mid-computation (Dask recomputes and the stage completes), killed
mid-training by xgboost.dask (the collective does not recover: the attempt fails or times out,
and the retry runs on restarted workers), past their ``memory_limit`` (the stage fails naming it),
unable to import the project's package (the stage fails at once, instead of Dask waiting for
workers that never come back)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from distributed import Client
from projects import Project
from subprocs import stop_group, wait_for

pytestmark = pytest.mark.slow

TASKS = """
    import os
    import signal
    import time
    from pathlib import Path

    import xgboost as xgb


    def square_dying_once(x, marker):
        if x == 3:
            try:  # the first worker to reach this item dies, as one killed by the OOM killer would
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        time.sleep(0.2)
        return x * x


    def survive(ctx):
        marker = str(ctx.root / "killed-once")
        futures = ctx.client.map(square_dying_once, range(8), marker=marker, pure=False)
        ctx.out().write_text(str(sum(ctx.client.gather(futures))))


    def allocate(n_bytes):
        held = b"x" * n_bytes  # written, so resident
        time.sleep(10)
        return len(held)


    def hog(ctx):
        ctx.out().write_text(str(ctx.client.submit(allocate, 600 * 2**20, pure=False).result()))


    class DieOnce(xgb.callback.TrainingCallback):  # the first worker to reach round 5 dies, once
        def __init__(self, marker):
            super().__init__()
            self.marker = marker

        def after_iteration(self, model, epoch, evals_log):
            if epoch == 5:
                try:
                    os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                    os.kill(os.getpid(), signal.SIGKILL)
                except FileExistsError:
                    pass
            return False


    def train(ctx):
        import dask.dataframe as dd
        import numpy as np
        import pandas as pd
        import xgboost.dask

        rng = np.random.default_rng(0)
        frame = pd.DataFrame(rng.normal(size=(2000, 4)), columns=list("abcd"))
        frame["y"] = (frame["a"] > 0).astype("int64")
        data = dd.from_pandas(frame, npartitions=2)
        matrix = xgboost.dask.DaskDMatrix(ctx.client, data[list("abcd")], data["y"])
        trained = xgboost.dask.train(ctx.client, {"objective": "binary:logistic"}, matrix, num_boost_round=20,
                                     callbacks=[DieOnce(str(ctx.root / "died-training"))],
                                     coll_cfg=xgb.collective.Config(tracker_host_ip="127.0.0.1"))
        trained["booster"].save_model(str(ctx.out()))


    def double(x):
        return 2 * x


    def elsewhere(ctx):
        ctx.out().write_text(str(ctx.client.submit(double, 21, pure=False).result()))
"""

SPEC = """
    pipeline: workers
    profiles:
      cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
      # the worker killed at its limit comes back through a spawn that, on 2 loaded cores, has taken
      # over the default 60 s: the stage must fail with Dask's KilledWorker, not conveyor's NoWorkers
      small: {kind: dask, n_workers: 1, threads_per_worker: 1, memory_limit: 300MiB, no_workers_timeout_s: 240}
      train: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
    stages:
      survive: {task: tasks.work:survive, on: cpu, outs: [data/survive.txt]}
      hog: {task: tasks.work:hog, on: small, outs: [data/hog.txt], timeout_s: 240}
      train: {task: tasks.work:train, on: train, outs: [models/xgb.json], timeout_s: 15, retries: 1,
              retry_delay_s: 0}
"""


def workers_project(make_project: Callable[[], Project]) -> Project:
    project = make_project()
    project.write("configs/pipeline.yaml", SPEC)
    project.write("tasks/__init__.py", "")
    project.write("tasks/work.py", TASKS)
    project.write("data/hog.txt", "old")
    return project


def test_killed_workers_are_replaced_restarted_after_a_timeout_and_memory_limits_named(
        make_project: Callable[[], Project]) -> None:
    project = workers_project(make_project)
    result = project.conveyor("run", timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    stages = project.record()["stages"]
    assert (project.root / "killed-once").exists()  # a worker did die mid-computation
    assert stages["survive"]["status"] == "succeeded", stages["survive"]
    assert (project.root / "data/survive.txt").read_text() == str(sum(x * x for x in range(8)))
    hog = stages["hog"]
    assert hog["status"] == "failed"
    assert "Dask workers of profile 'small' died running its task 'allocate-" in hog["error"]
    assert "300MiB (memory_limit)" in hog["error"]
    assert (project.root / "data/hog.txt").read_text() == "old"
    assert "stage 'hog' failed" in result.stdout
    train = stages["train"]
    assert (project.root / "died-training").exists()  # a worker died mid-training
    # the collective failed (or, waiting for the dead peer, timed out); the retry ran on restarted workers
    assert train["status"] == "succeeded" and train["attempts"] == 2, train
    assert (project.root / "models/xgb.json").exists()
    log = next((project.root / ".conveyor/logs").glob("*/train.log")).read_text()
    assert "before attempt 2: restarted the workers of profile 'train'" in log
    assert project.left_running() == []


REMOTE = """
    pipeline: remote
    profiles:
      remote: {{kind: dask, address: "{address}"}}
    stages:
      elsewhere: {{task: tasks.work:elsewhere, on: remote, outs: [data/elsewhere.txt]}}
"""


SHIPPED = """
    import json
    import sys

    import dask.bag as db
    from distributed import get_worker

    from tasks import helpers


    def where_tasks_comes_from(_=None):
        module = sys.modules.get("tasks")
        return [get_worker().name, getattr(module, "__file__", None)]


    def elsewhere(ctx):
        submitted = ctx.client.submit(helpers.tag, "submitted", pure=False).result()
        mapped = db.from_sequence(["a", "b", "c"], npartitions=3).map(helpers.tag).compute()  # a graph
        seen = ctx.client.gather(ctx.client.map(where_tasks_comes_from, range(4), pure=False))
        ctx.out().write_text(json.dumps({"submitted": submitted, "mapped": mapped, "tasks": seen}))
"""


@pytest.fixture
def workers_lacking_the_project(make_project: Callable[[], Project], tmp_path: Path) -> Iterator[Project]:
    """A project on a cluster whose scheduler and workers have none of its code: the scheduler has no
    PYTHONPATH, the workers find another project's package of the same name, ``tasks``."""
    project = make_project()
    decoy = tmp_path / "decoy"
    (decoy / "tasks").mkdir(parents=True)
    (decoy / "tasks/__init__.py").write_text("")
    (decoy / "tasks/helpers.py").write_text("def tag(x):\n    return f'decoy:{x}'\n")
    (decoy / "tasks/work.py").write_text("def elsewhere(ctx):\n    raise RuntimeError('the decoy ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    common = {"cwd": tmp_path, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    # the scheduler takes a port of its own and says which in its file: a port picked beforehand can be taken
    # by another process (the worker's own listener among them) before the scheduler binds it
    scheduler_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen(["dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--scheduler-file",
                               str(scheduler_file), "--dashboard-address", "127.0.0.1:0"], env=env, **common)]
    try:
        address = _scheduler_address(scheduler_file, procs[0])
        procs += [subprocess.Popen(["dask", "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                                    "--dashboard-address", "127.0.0.1:0", "--name", f"w{i}"],
                                   env={**env, "PYTHONPATH": str(decoy)}, **common) for i in range(2)]
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
        project.write("configs/pipeline.yaml", REMOTE.format(address=address))
        project.write("tasks/__init__.py", "")
        project.write("tasks/work.py", SHIPPED)
        project.write("tasks/helpers.py", "def tag(x):\n    return f'v1:{x}'\n")
        yield project
    finally:
        for proc in reversed(procs):
            stop_group(proc)


def _scheduler_address(scheduler_file: Path, scheduler: subprocess.Popen[bytes], timeout_s: float = 120) -> str:
    """The address a ``dask scheduler --scheduler-file`` listens on, once it has written its file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert scheduler.poll() is None, f"the dask scheduler exited with {scheduler.returncode}"
        try:
            return str(json.loads(scheduler_file.read_text())["address"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)  # not written yet (or half written)
    raise AssertionError(f"the dask scheduler wrote no {scheduler_file.name} within {timeout_s:g} s")


def test_the_project_code_travels_with_the_run_to_workers_that_lack_it(workers_lacking_the_project: Project
                                                                        ) -> None:
    """Nothing of the project on the cluster: the task's functions and the graph it builds run there,
    as they are at this run (an edit is what runs next, no restart), never the other project's."""
    project = workers_lacking_the_project
    first = project.conveyor("run", timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    done = json.loads((project.root / "data/elsewhere.txt").read_text())
    assert done["submitted"] == "v1:submitted" and done["mapped"] == ["v1:a", "v1:b", "v1:c"]
    assert {file for _, file in done["tasks"]} <= {None, str(project.root.parent / "decoy/tasks/__init__.py")}

    project.write("tasks/helpers.py", "def tag(x):\n    return f'v2:{x}'\n")  # edited, the cluster untouched
    again = project.conveyor("run", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    done = json.loads((project.root / "data/elsewhere.txt").read_text())
    assert done["submitted"] == "v2:submitted" and done["mapped"] == ["v2:a", "v2:b", "v2:c"]


# --------------------------------------------------------------------------- an existing cluster loses its workers

GONE = """
    pipeline: gone
    profiles:
      remote: {{kind: dask, address: "{address}", no_workers_timeout_s: {bound}}}
    stages:
      command: {{cmd: "{command}", on: remote, outs: [data/command.txt]}}
      {task}
"""
WAITING_TASK = "task: {task: tasks.work:wait_on_worker, on: remote, outs: [data/task.txt]}"
NAP = """
    import time
    from pathlib import Path


    def nap(marker):
        Path(marker).touch()
        time.sleep(300)


    def wait_on_worker(ctx):
        ctx.client.submit(nap, str(ctx.root / "task.started"), pure=False).result()
        ctx.out().write_text("new")
"""


class Cluster:
    """A ``dask scheduler`` started by the test, and ``dask worker`` processes it starts and kills."""

    def __init__(self, tmp_path: Path, project: Project) -> None:
        self.tmp_path, self.project = tmp_path, project
        self.common = {"cwd": tmp_path, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                       "start_new_session": True}
        scheduler_file = tmp_path / "scheduler.json"
        self.procs = [subprocess.Popen(["dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--scheduler-file",
                                        str(scheduler_file), "--dashboard-address", "127.0.0.1:0"],
                                       env=self.env(tagged=False), **self.common)]
        self.address = _scheduler_address(scheduler_file, self.procs[0])

    def env(self, *, tagged: bool) -> dict[str, str]:
        """The project's environment (importable tasks); ``tagged``: what it starts counts as the run's."""
        env = {**self.project.env, "PYTHONPATH": str(self.project.root)}
        if not tagged:
            env.pop("CONVEYOR_TEST_TAG")
        return env

    def start_worker(self, *, tagged: bool) -> subprocess.Popen[bytes]:
        """A worker, once the scheduler has it. Tagged: the commands it runs carry the run's tag
        (a command inherits its worker's environment), so a command left running is seen."""
        n = len(self.procs)
        self.procs.append(subprocess.Popen(["dask", "worker", self.address, "--nthreads", "2", "--host", "127.0.0.1",
                                            "--dashboard-address", "127.0.0.1:0", "--name", f"w{n}"],
                                           env=self.env(tagged=tagged), **self.common))
        with Client(self.address, timeout="60s") as client:
            client.wait_for_workers(1, timeout=120)
        return self.procs[-1]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop_group(proc)


@pytest.fixture
def cluster(make_project: Callable[[], Project], tmp_path: Path) -> Iterator[Cluster]:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/work.py", NAP)
    project.write("data/command.txt", "old")
    project.write("data/task.txt", "old")
    cluster = Cluster(tmp_path, project)
    try:
        yield cluster
    finally:
        cluster.close()


def finish(run: subprocess.Popen[str], timeout_s: float) -> str:
    """What the run wrote, once it exited; killed (and the test failed) if it is still running after ``timeout_s``."""
    try:
        return run.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        run.kill()
        output = run.communicate()[0]
        raise AssertionError(f"the run still waited {timeout_s:g} s later:\n{output[-3000:]}") from None


def test_a_cluster_that_loses_every_worker_fails_its_stages_within_the_bound(cluster: Cluster) -> None:
    project, bound = cluster.project, 5
    project.write("configs/pipeline.yaml", GONE.format(
        address=cluster.address, bound=bound, task=WAITING_TASK,
        command="touch command.started && sleep 300 && echo new > data/command.txt"))
    worker = cluster.start_worker(tagged=True)
    run = project.popen("run")
    wait_for(project.root / "command.started", run)
    wait_for(project.root / "task.started", run)
    os.killpg(worker.pid, signal.SIGKILL)  # the worker and its nanny, as the OOM killer or an operator would
    killed = time.monotonic()

    output = finish(run, timeout_s=bound + 60)
    # a command's wait hears it at once, a task's wait on Dask futures within 10 s (distributed's steps)
    assert time.monotonic() - killed < bound + 20, output
    assert run.returncode == 1, output
    assert "Traceback" not in output
    stages = project.record()["stages"]
    for name in ("command", "task"):
        assert stages[name]["status"] == "failed", stages[name]
        assert (f"the Dask scheduler at {cluster.address} (profile 'remote') has had no workers for {bound}s "
                "(no_workers_timeout_s)") in stages[name]["error"]
        assert f"stage '{name}' failed" in output
        assert (project.root / f"data/{name}.txt").read_text() == "old"
    assert project.left_running() == []  # the killed worker's command went with it


def test_a_cluster_with_no_worker_yet_fails_its_first_stage_within_the_bound(cluster: Cluster) -> None:
    """The check that the workers see the project's disk waits for a first worker: the bound ends
    that wait as it ends a stage's (and the check's marker file is gone)."""
    project, bound = cluster.project, 3
    project.write("configs/pipeline.yaml", GONE.format(address=cluster.address, bound=bound, task="",
                                                       command="echo new > data/command.txt"))
    run = project.popen("run")
    output = finish(run, timeout_s=bound + 60)
    assert run.returncode == 1, output
    assert "Traceback" not in output
    assert (f"the Dask scheduler at {cluster.address} (profile 'remote') has had no workers for {bound}s "
            "(no_workers_timeout_s)") in project.record()["stages"]["command"]["error"]
    assert (project.root / "data/command.txt").read_text() == "old"
    assert not list((project.root / ".conveyor").glob("probe-*"))


def test_a_worker_back_within_the_bound_lets_the_stage_go_on(cluster: Cluster) -> None:
    project = cluster.project
    second_time = ("if [ -e command.started ]; then echo new > data/command.txt; "
                   "else touch command.started; sleep 300; fi")
    project.write("configs/pipeline.yaml", GONE.format(address=cluster.address, bound=60, task="", command=second_time))
    worker = cluster.start_worker(tagged=True)
    run = project.popen("run")
    wait_for(project.root / "command.started", run)
    os.killpg(worker.pid, signal.SIGKILL)
    cluster.start_worker(tagged=False)  # Dask gives the waiting task to it: the command runs again there

    output = finish(run, timeout_s=120)
    assert run.returncode == 0, output
    assert (project.root / "data/command.txt").read_text() == "new\n"
    assert project.left_running() == []


# --------------------------------------------------------------------------- a command past its worker's memory_limit

MEMORY = """
    pipeline: memory
    profiles:
      small: {kind: dask, n_workers: 1, threads_per_worker: 2, memory_limit: 200MiB}
    stages:
      big:
        # ten times the limit, written (so resident), held a while
        cmd: python -c "b = bytearray(2_000_000_000); import time; time.sleep(5)" && echo new > data/big.txt
        on: small
        outs: [data/big.txt]
      modest:
        cmd: python -c "b = bytearray(20_000_000)" && echo new > data/modest.txt
        on: small
        outs: [data/modest.txt]
"""


def test_a_command_past_its_workers_memory_limit_fails_as_a_task_does(make_project: Callable[[], Project]) -> None:
    project = make_project()
    project.write("configs/pipeline.yaml", MEMORY)
    project.write("data/big.txt", "old")
    result = project.conveyor("run", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    stages = project.record()["stages"]
    big = stages["big"]
    assert big["status"] == "failed", big
    # the words a task past memory_limit gets (see the hog stage above)
    assert "its command's processes on a Dask worker of profile 'small' used" in big["error"]
    assert "each worker may use 200MiB (memory_limit), and a command past 95% of it is killed" in big["error"]
    assert "stage 'big' failed" in result.stdout
    assert (project.root / "data/big.txt").read_text() == "old"
    assert stages["modest"]["status"] == "succeeded", stages["modest"]
    assert (project.root / "data/modest.txt").read_text() == "new\n"
    assert project.left_running() == []
