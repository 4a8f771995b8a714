"""A `slurm` profile against a real Slurm: slurmctld and slurmd on this machine, started by
scripts/slurm-single-node.sh (root, Debian's slurm-wlm and munge; skipped elsewhere).

The work of a stage runs in a Slurm job (its SLURM_JOB_ID, the job completion log); Ctrl-C
and kill -9 of the runner leave no job in squeue; a job Slurm kills at its time limit fails
the stages on it with Slurm's reason instead of Dask waiting for workers forever. No
slurmdbd here, so no sacct: how a job ended is read from squeue (which keeps an ended job
for MinJobAge) and the job completion log (jobcomp/filetxt).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from projects import REPO, Project

SCRIPT = REPO / "scripts/slurm-single-node.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")

SPEC = """
    pipeline: on-slurm
    profiles:
      hpc: {kind: slurm, cores: 2, memory: 1GiB, walltime: "WALLTIME", interface: lo, jobs: 1}
    stages:
      command:
        cmd: echo "$SLURM_JOB_ID" > command.started && echo "$SLURM_JOB_ID" > data/command.txt && sleep SLEEP
        outs: [data/command.txt]
        on: hpc
      task:
        task: tasks.where:job_id
        outs: [data/task.txt]
        on: hpc
"""

TASK = """
    import os
    import time


    def on_worker(sleep_s, marker):
        with open(marker, "w") as file:
            file.write(os.environ.get("SLURM_JOB_ID", ""))
        time.sleep(sleep_s)
        return os.environ.get("SLURM_JOB_ID", "")


    def job_id(ctx):
        sleep_s = float((ctx.root / "task.sleep").read_text())
        marker = str(ctx.root / "task.started")
        ctx.out().write_text(ctx.client.submit(on_worker, sleep_s, marker, pure=False).result())
"""


def _why_no_slurm() -> str:
    if os.geteuid() != 0:
        return "a single-node Slurm needs root (slurmd runs jobs as their users)"
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"no {', '.join(missing)} here: apt-get install slurm-wlm munge"
    return ""


# skipped before any fixture starts (the session's Prefect server among them)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_why_no_slurm()), reason=_why_no_slurm() or "-")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """munged, slurmctld and slurmd for this module; yields the clients' environment (SLURM_CONF).
    Afterwards no daemon of it is left."""
    if why := _why_no_slurm():
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run([str(SCRIPT), "start", str(folder)], capture_output=True, text=True, timeout=120)
    env = {"SLURM_CONF": str(folder / "slurm.conf")}
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield env
    finally:
        pids = [int(p.read_text()) for p in (folder / "slurmd.pid", folder / "slurmctld.pid",
                                              folder / "munge/munged.pid") if p.exists()]
        stopped = subprocess.run([str(SCRIPT), "stop", str(folder)], capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert [pid for pid in pids if _alive(pid)] == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _slurm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def active_jobs(env: dict[str, str]) -> list[str]:
    """Jobs pending, running or completing: what squeue lists by default."""
    return _slurm(env, "squeue", "-h", "-o", "%i %j %T").splitlines()


def wait_no_jobs(env: dict[str, str], timeout_s: float) -> tuple[list[str], float]:
    """(the jobs still in squeue after ``timeout_s``, or [], and how long it took)."""
    t0 = time.monotonic()
    while (left := active_jobs(env)) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)  # squeue is the only way to see it: nothing to wait on
    return left, time.monotonic() - t0


def ended(env: dict[str, str], job: str) -> str:
    """How Slurm says the job ended: its line in the job completion log."""
    log = Path(env["SLURM_CONF"]).parent / "log/jobcomp.txt"
    lines = [line for line in log.read_text().splitlines() if line.startswith(f"JobId={job} ")]
    assert len(lines) == 1, log.read_text()
    return lines[0]


@pytest.fixture
def slurm_project(make_project: Callable[[], Project], slurm: dict[str, str]) -> Callable[..., Project]:
    def make(walltime: str = "00:05:00", sleep_s: int = 0, extra: str = "") -> Project:
        project = make_project()
        project.env.update(slurm)
        spec = SPEC.replace("WALLTIME", walltime).replace("SLEEP", str(sleep_s)).replace("jobs: 1", f"jobs: 1{extra}")
        project.write("configs/pipeline.yaml", spec)
        project.write("tasks/__init__.py", "")
        project.write("tasks/where.py", TASK)
        project.write("task.sleep", str(sleep_s))
        return project

    return make


def test_a_command_and_a_task_run_in_a_slurm_job(slurm_project: Callable[..., Project],
                                                   slurm: dict[str, str]) -> None:
    project = slurm_project()
    done = project.conveyor("run", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job = (project.root / "data/command.txt").read_text().strip()
    assert job.isdigit(), job
    assert (project.root / "data/task.txt").read_text() == job  # the task's work ran on that job's worker
    line = ended(slurm, job)
    assert "Name=conveyor-hpc " in line and "JobState=CANCELLED " in line  # cancelled by conveyor at the end
    assert active_jobs(slurm) == []
    assert project.left_running() == []


def _started_job(project: Project, run: subprocess.Popen[str], timeout_s: float = 120) -> str:
    """The Slurm job that the command and the task's work both run in, once both started."""
    markers = [project.root / "command.started", project.root / "task.started"]
    deadline = time.monotonic() + timeout_s
    while not all(marker.exists() and marker.read_text().strip() for marker in markers):
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, "the stages never started on a Slurm worker"
        time.sleep(0.1)  # a file another process writes: nothing to wait on but the file
    jobs = {marker.read_text().strip() for marker in markers}
    assert len(jobs) == 1, jobs
    return str(jobs.pop())


def test_ctrl_c_cancels_the_runs_jobs(slurm_project: Callable[..., Project], slurm: dict[str, str]) -> None:
    project = slurm_project(sleep_s=600)
    run = project.popen("run")
    job = _started_job(project, run)
    assert any(line.startswith(f"{job} ") for line in active_jobs(slurm))
    run.send_signal(signal.SIGINT)
    output = run.communicate(timeout=120)[0]
    assert run.returncode == 130, output
    assert "interrupted (SIGINT)" in output and "Traceback" not in output
    left, _took = wait_no_jobs(slurm, timeout_s=10)
    assert left == []
    assert "JobState=CANCELLED " in ended(slurm, job)
    assert project.left_running() == []


def test_kill_9_of_the_runner_leaves_no_job(slurm_project: Callable[..., Project], slurm: dict[str, str]) -> None:
    """Nobody cancels the job: its Dask workers lose their scheduler, close (a thread busy in a
    task holds one up to distributed's 30 s), and the job script ends with them."""
    project = slurm_project(sleep_s=600)
    run = project.popen("run")
    job = _started_job(project, run)  # both of the job's workers busy
    run.kill()
    run.communicate(timeout=30)
    left, took = wait_no_jobs(slurm, timeout_s=90)
    assert left == [], f"still in squeue {took:.0f}s after kill -9: {left}"
    assert "JobState=COMPLETED " in ended(slurm, job)
    assert project.left_running() == []  # the command in the job went with it (Slurm ends the job's processes)


def test_a_job_killed_at_its_time_limit_fails_its_stages_with_slurms_reason(
        slurm_project: Callable[..., Project], slurm: dict[str, str]) -> None:
    """Slurm checks time limits every 30 s: a one-minute job ends 60 to 90 s after it started."""
    project = slurm_project(walltime="00:01:00", sleep_s=600)
    t0 = time.monotonic()
    done = project.conveyor("run", timeout=200)
    took = time.monotonic() - t0
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    job = (project.root / "command.started").read_text().strip()
    assert "JobState=TIMEOUT " in ended(slurm, job)
    stages = project.record()["stages"]
    for name in ("command", "task"):
        assert stages[name]["status"] == "failed", stages[name]
        assert (f"Slurm job {job} (conveyor-hpc) ended TIMEOUT (TimeLimit): it ran past the profile's walltime "
                "(00:01:00); raise walltime") in stages[name]["error"]
    assert took < 150, f"the run took {took:.0f}s"  # Slurm's kill, then squeue asked within seconds
    assert not (project.root / "data/task.txt").exists()
    assert active_jobs(slurm) == []
    assert project.left_running() == []


def test_a_job_slurm_refuses_fails_its_stages_with_sbatchs_error(
        slurm_project: Callable[..., Project], slurm: dict[str, str]) -> None:
    """dask-jobqueue submits from its event loop and keeps sbatch's error to itself."""
    project = slurm_project(extra=", queue: no-such-partition")
    done = project.conveyor("run", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    for stage in project.record()["stages"].values():
        assert stage["status"] == "failed", stage
        assert ("profile 'hpc': Slurm took no job for its workers: sbatch: error: invalid partition specified: "
                "no-such-partition") in stage["error"]
    assert active_jobs(slurm) == []
    assert project.left_running() == []


def test_a_job_slurm_queues_but_will_never_start_fails_its_stages_at_once(
        slurm_project: Callable[..., Project], slurm: dict[str, str]) -> None:
    """A walltime over the partition's limit: Slurm takes the job and keeps it PENDING
    (PartitionTimeLimit) for ever; the run fails within seconds, saying what to change, and
    cancels the job."""
    project = slurm_project(extra=", queue: short")  # its MaxTime is 1 minute, the profile asks for 5
    t0 = time.monotonic()
    done = project.conveyor("run", timeout=120)
    took = time.monotonic() - t0
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    for stage in project.record()["stages"].values():  # Slurm 22 says PartitionConfig, others PartitionTimeLimit
        assert stage["status"] == "failed", stage
        assert re.search(r"\(conveyor-hpc\) is PENDING \(Partition(Config|TimeLimit)\) and will never start: .*"
                         r"walltime.*00:05:00.* or pick another queue", stage["error"]), stage["error"]
    assert took < 60, f"the run took {took:.0f}s"
    assert active_jobs(slurm) == []
    assert project.left_running() == []
