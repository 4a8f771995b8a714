"""Dask workers as Slurm jobs (dask-jobqueue), and what Slurm says of those jobs.

The scheduler runs in conveyor's process; each job runs Dask workers. When a job ends
under a stage (its time limit, ``scancel``, a node failure), Dask only sees workers leave
and would wait for new ones forever: :class:`SlurmJobs` asks Slurm how the jobs ended, so
the stage fails with Slurm's reason instead. dask_jobqueue is imported only here, on use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from conveyor.errors import ProfileError
from conveyor.spec.profiles import SlurmProfile

# job states after which the job runs no worker again (squeue's long names)
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
# reasons a job stays PENDING that no amount of waiting resolves: the request must change
# (https://slurm.schedmd.com/job_reason_codes.html); "Resources", "Priority", limits reached: it waits
NEVER_STARTS = {
    "PartitionTimeLimit": "the profile's walltime ({walltime}) is over the partition's time limit: lower walltime "
                          "or pick another queue",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows: lower jobs' size or pick another "
                          "queue",
    "PartitionConfig": "the job asks for more than the partition allows (cores {cores}, memory {memory}, walltime "
                       "{walltime}): lower them or pick another queue",
    "BadConstraints": "no node meets the job's constraints (job_extra): change them",
    "InvalidAccount": "the account ({account}) is not valid here: fix the profile's account",
    "InvalidQOS": "the QOS is not valid here: fix the QOS in job_extra",
    "AccountNotAllowed": "the account ({account}) may not use the partition: pick another queue or account",
    "QOSNotAllowed": "the QOS may not use the partition: pick another queue or QOS",
}
SUBMIT_TIMEOUT_S = 60.0  # for sbatch to answer
ASK_EVERY_S = 5.0  # how often squeue runs while a stage waits for workers: not a load on slurmctld
_IMPORTING = threading.Lock()


def _slurm_cluster_class() -> Any:
    """dask_jobqueue's SLURMCluster, imported without its side effect on signals.

    ``dask_jobqueue.runner`` sets SIGINT to ``sys.exit`` when imported: from the main thread
    that would replace conveyor's Ctrl-C handling (the run would exit without its summary), and
    from a profile's starting thread the import fails ("signal only works in main thread").
    Only that module's call is skipped; every other caller of ``signal.signal`` is served.
    """
    real = signal.signal

    def skip_jobqueue_runner(signum: Any, handler: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") == "dask_jobqueue.runner":
            return signal.getsignal(signum)
        return real(signum, handler)

    with _IMPORTING:
        signal.signal = skip_jobqueue_runner  # type: ignore[assignment]
        try:
            from dask_jobqueue.slurm import SLURMCluster
        finally:
            signal.signal = real
    return SLURMCluster


def slurm_cluster(name: str, profile: SlurmProfile) -> Any:
    """A dask-jobqueue SLURMCluster for the profile (its scheduler runs here; no job submitted yet)."""
    try:
        cluster_class = _slurm_cluster_class()
    except ImportError as exc:
        raise ProfileError(f"profile '{name}' needs dask-jobqueue: pip install 'conveyor[slurm]' ({exc})") from exc
    options: dict[str, Any] = {
        "queue": profile.queue, "account": profile.account, "interface": profile.interface,
        "cores": profile.cores, "memory": profile.memory, "walltime": profile.walltime,
        "processes": profile.processes, "job_extra_directives": list(profile.job_extra),
        "job_name": f"conveyor-{name}",
    }
    if profile.resources:  # what each worker declares, as `dask worker --resources` (a GPU job: {GPU: 1})
        options["worker_extra_args"] = ["--resources", ",".join(f"{k}={v:g}" for k, v in profile.resources.items())]
    return cluster_class(**{k: v for k, v in options.items() if v is not None})


def _failed(jobs: list[Any]) -> None:
    """Mark jobs that sbatch refused as failed, which they are: closing the cluster asserts that
    every job it created is closed or failed, and would raise over a refused one (still 'created')."""
    from distributed.core import Status

    for job in jobs:
        job.status = Status.failed


class SlurmJobs:
    """The Slurm jobs a profile's cluster submitted, every one it ever had (dask-jobqueue forgets
    a job once its workers left), and how they ended."""

    def __init__(self, name: str, profile: SlurmProfile, cluster: Any) -> None:
        self.name, self.profile, self._cluster = name, profile, cluster
        self._ids: dict[str, None] = {}  # in submission order
        self._asked = (-ASK_EVERY_S, "")  # (when, answer): Slurm is asked at most every ASK_EVERY_S
        self._lock = threading.Lock()

    def wait_submitted(self, jobs: int, timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
        """Wait until the cluster's ``jobs`` are submitted (sbatch answered), and note their ids: a
        job that ends before any stage waits on it is then still known. dask-jobqueue submits
        from its event loop after ``scale`` and drops sbatch's error there: a job left with no id
        was refused, and ``sbatch --test-only`` says why."""
        deadline = time.monotonic() + timeout_s
        while len(self._job_ids()) < jobs:
            refused = [job for job in self._jobs() if getattr(job, "job_id", "") is None]
            if refused or time.monotonic() > deadline:
                _failed(refused)
                raise ProfileError(f"profile '{self.name}': Slurm took no job for its workers: "
                                   f"{self._refusal() if refused else f'sbatch did not answer in {timeout_s:g}s'}")
            time.sleep(0.1)  # the cluster's event loop fills cluster.workers: nothing to wait on

    def _refusal(self) -> str:
        """sbatch's own words on the profile's job script (``--test-only``: nothing is submitted)."""
        with tempfile.NamedTemporaryFile("w", suffix=".sh") as script:
            script.write(self._cluster.job_script())
            script.flush()
            try:
                done = subprocess.run(["sbatch", "--test-only", script.name], capture_output=True, text=True,
                                      timeout=30, env=os.environ)
            except (OSError, subprocess.SubprocessError) as exc:
                return f"sbatch failed ({exc})"
        lines = [line.strip() for line in done.stderr.splitlines() if "error" in line.lower()]
        return lines[0] if lines else "sbatch refused the job script (queue, account, memory, walltime?)"

    def ended(self) -> str:
        """Why no job of the cluster will run a worker again, in Slurm's words; "" while one is
        pending or running, or none was submitted yet, or Slurm does not answer. Called every
        second by each stage waiting for a worker; squeue runs at most every ASK_EVERY_S."""
        with self._lock:
            when, answer = self._asked
            if time.monotonic() - when >= ASK_EVERY_S:
                answer = self._ask()
                self._asked = (time.monotonic(), answer)
            return answer

    def _ask(self) -> str:
        ids = self._job_ids()
        if not ids:
            return ""
        states = job_states(ids)
        if states is None or any(state and state not in ENDED and not _never_starts(state, reason)
                                 for state, reason in states.values()):
            return ""
        return "; ".join(self._said(job, state, reason) for job, (state, reason) in states.items())

    def _said(self, job: str, state: str, reason: str) -> str:
        """One job's end as a line: Slurm's state and reason, and what the profile can change."""
        if _never_starts(state, reason):
            p = self.profile
            fix = NEVER_STARTS[reason].format(walltime=p.walltime, cores=p.cores, memory=p.memory, account=p.account)
            return f"Slurm job {job} (conveyor-{self.name}) is PENDING ({reason}) and will never start: {fix}"
        if not state:
            return f"Slurm job {job} (conveyor-{self.name}) ended over MinJobAge ago (squeue no longer lists it)"
        why = f" ({reason})" if reason not in ("", "None") else ""
        hint = {"TIMEOUT": f": it ran past the profile's walltime ({self.profile.walltime}); raise walltime",
                "OUT_OF_MEMORY": f": it used more than the profile's memory ({self.profile.memory}); raise memory",
                "CANCELLED": ": cancelled by someone else (scancel, an administrator)"}.get(state, "")
        return f"Slurm job {job} (conveyor-{self.name}) ended {state}{why}{hint}"

    def _job_ids(self) -> list[str]:
        for job in self._jobs():
            if getattr(job, "job_id", None):
                self._ids.setdefault(str(job.job_id))
        return list(self._ids)

    def _jobs(self) -> tuple[Any, ...]:
        """The cluster's job objects now (dask-jobqueue's, one per Slurm job it submitted)."""
        for _try in range(3):  # the cluster's event loop changes the dict as jobs come and go
            try:
                return tuple(self._cluster.workers.values())
            except RuntimeError:
                continue
        return ()


def _never_starts(state: str, reason: str) -> bool:
    return state == "PENDING" and reason in NEVER_STARTS


def job_states(ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """``{job id: (state, reason)}`` from squeue, which keeps an ended job for MinJobAge (300 s
    by default); a job it no longer lists has state "". None when Slurm does not answer."""
    try:
        done = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r"],
                              capture_output=True, text=True, timeout=30, env=os.environ)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 and "Invalid job id" not in done.stderr:  # its one job forgotten, or no answer
        return None
    states = dict.fromkeys(ids, ("", ""))
    for line in done.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job in states:
            states[job] = (state, reason)
    return states
