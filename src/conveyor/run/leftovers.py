"""What a run's tasks started and left running: ended with the command that ran them.

A ``cmd`` stage's commands run under a guard that ends whatever they leave (:mod:`conveyor.run.guard`).
A task runs in conveyor's own process, and what it starts, a ``subprocess.Popen`` never waited for,
a ``multiprocessing.Process`` never joined, a server it meant to stop, is still that process's
after the task returned. So once a command that runs stages (``run``, ``exec``) has
stopped what it started itself (clusters, a temporary Prefect server, the stages' commands), every
process still under it is a leftover of its tasks, but for

- what conveyor starts to outlive the command (a kept Prefect server, a warm runner): started with
  :data:`OUTLIVES` in its environment naming the process that started it, by its pid and start
  (:func:`outliving`), which the processes it starts inherit. A process forked without an exec
  shows the environment its process was started with, never this one's: a task's fork of a run a
  warm runner forked is ended;
- Python's multiprocessing helpers (its resource tracker, loky's, a forkserver) and joblib's
  reusable workers (scikit-learn's ``n_jobs``: kept for the next call, by design), which end with
  the process by themselves.

Each leftover gets SIGTERM, then SIGKILL after :data:`GRACE_S`, and the command says which, in one
line. A ``conveyor run`` killed before it could (``kill -9``, the OOM killer) leaves them to the next
command in the project, which settles the killed run's record: a run's process puts the run's id in
its environment (:data:`RUN`), which what its tasks start inherits, and a run that leads a session
of its own (a warm runner's fork; a flow run Prefect started so) has what its tasks fork without an
exec in it (its pid and start are written beside the run's record until it ends: :func:`marked`,
:func:`end_killed_runs`). A process that detached itself (a daemon's double fork, ``nohup cmd &``
through ``os.system``) is init's by then: out of reach here, as it is of ``dvc repro`` (a ``cmd``
stage's guard catches those).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.workspace import state_dir

if TYPE_CHECKING:
    import psutil

OUTLIVES = "CONVEYOR_OUTLIVES"
RUN = "CONVEYOR_RUN_ID"  # as a cmd stage's commands get it (conveyor.run.stage)
GRACE_S = 3.0  # between SIGTERM and SIGKILL
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "loky.backend.resource_tracker",
            "loky.backend.popen_loky")


def outliving(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a process this one starts to outlive it (never ended as a leftover)."""
    return {**env, OUTLIVES: _me()}


def _me() -> str:
    """This process: its pid and its start (in clock ticks since boot), which a later process given the
    same pid does not share."""
    found = _stat(os.getpid())
    return f"{os.getpid()}.{found[1] if found is not None else ''}"


def existing() -> frozenset[tuple[int, float]]:
    """The processes under this one now, as (pid, start time): what a sweep later leaves alone."""
    if not _any_children():
        return frozenset()
    import psutil

    found = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found.add((proc.pid, proc.create_time()))
    return frozenset(found)


def leftovers(before: frozenset[tuple[int, float]] = frozenset()) -> list[psutil.Process]:
    """The processes under this one that are neither kept on purpose nor multiprocessing's helpers,
    nor among ``before`` (:func:`existing`)."""
    import psutil

    me = _me()
    try:
        under = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    found, parents = [], {}
    for proc in under:
        with contextlib.suppress(psutil.Error):  # gone meanwhile: nothing to end
            if proc.status() != psutil.STATUS_ZOMBIE:
                parents[proc.pid] = proc.ppid()
                found.append(proc)
    kept = {p.pid for p in found if _environ(p).get(OUTLIVES) == me or _is_helper(p) or _in(p, before)}

    def under_kept(pid: int) -> bool:
        while pid in parents:
            if pid in kept:
                return True
            pid = parents[pid]
        return False

    return [p for p in found if not under_kept(p.pid)]


def end_leftovers(grace_s: float = GRACE_S, before: frozenset[tuple[int, float]] = frozenset()) -> list[str]:
    """End :func:`leftovers`: SIGTERM, then SIGKILL to those still there after ``grace_s``; each as
    ``PID (command line)``."""
    if not _any_children():
        return []
    return _end(leftovers(before), grace_s)


def _session_file(root: Path, run_id: str) -> Path:
    """Where a running run's process, leading a session of its own, names itself, beside its record."""
    return state_dir(root) / "runs" / f"{run_id}.session"


@contextlib.contextmanager
def marked(run_id: str, root: Path) -> Iterator[None]:
    """While a run runs in this process, the processes its tasks start carry the run's id
    (:data:`RUN`), for a later command to end them should this process be killed before it could
    (:func:`end_killed_runs`). A process a task forks without an exec shows the environment its
    parent started with, not this one's; when this process leads a session of its own (a run a warm
    runner forked; a deployment's flow run Prefect started in a group of its own), such forks stay
    in it: a file beside the run's record names this process and the run's start, and goes as the
    run ends."""
    before = os.environ.get(RUN)
    os.environ[RUN] = run_id
    session_file = _session_file(root, run_id)
    leads = os.getsid(0) == os.getpid()
    if leads:
        with contextlib.suppress(OSError):  # a full disk: only the forks of a killed run go unfound
            session_file.parent.mkdir(parents=True, exist_ok=True)
            session_file.write_text(f"{_me()} {_now()}", encoding="utf-8")
    try:
        yield
    finally:
        if leads:
            with contextlib.suppress(OSError):
                session_file.unlink(missing_ok=True)
        if before is None:
            os.environ.pop(RUN, None)
        else:
            os.environ[RUN] = before


def _now() -> int:
    """Now, in the clock ticks since boot that /proc gives a process's start in."""
    try:
        return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0


def end_killed_runs(run_id: str, root: Path, grace_s: float = GRACE_S) -> list[str]:
    """What the run ``run_id`` of the project at ``root``, killed (``kill -9``, the OOM killer) before it
    could end its tasks' leftovers, left running: the user's processes started with its id, and those
    still in its session (:func:`marked`), but what is kept on purpose."""
    import psutil

    session_file = _session_file(root, run_id)
    session = _dead_session(session_file)
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # another user's, or gone meanwhile
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            started = env.get(RUN) == run_id and OUTLIVES not in env
            # a fork shows the environment its process started with: a warm runner's, which names
            # who started that runner to outlive it, never this run (what this run kept names it)
            forked = session is not None and _in_session(proc.pid, session) and env.get(OUTLIVES) != session[0]
            if started or forked:
                found.append(proc)
    session_file.unlink(missing_ok=True)
    return _end(found, grace_s)


def _stat(pid: int) -> tuple[int, int] | None:
    """A process's session and start (clock ticks since boot), from /proc; None once it is gone or a
    zombie (a killed run its runner has not reaped yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return None if fields[0] == "Z" else (int(fields[3]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _dead_session(session_file: Path) -> tuple[str, int, int, float] | None:
    """The killed run's session as (its process as :func:`_me` names it, the session's id, the run's
    start, the start of a later process given that pid, if any: what started after that may be in
    that one's session), None if none."""
    try:
        named, run_start = session_file.read_text(encoding="utf-8").split()
        pid, _, start = named.partition(".")
        leader, began, ran = int(pid), int(start), int(run_start)
    except (OSError, ValueError):
        return None
    now = _stat(leader)
    if now is None:
        return named, leader, ran, float("inf")
    if now[1] == began:  # the run's process is there after all: not a killed run's leftovers
        return None
    return named, leader, ran, now[1]


def _in_session(pid: int, session: tuple[str, int, int, float]) -> bool:
    found = _stat(pid)
    return found is not None and found[0] == session[1] and session[2] <= found[1] < session[3]


def _end(found: list[psutil.Process], grace_s: float) -> list[str]:
    import psutil

    shown = [_shown(p) for p in found]
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return shown


@contextlib.contextmanager
def ended_after(say: Callable[[str], None], *, new_only: bool = False) -> Iterator[Callable[[], None]]:
    """Around a command that runs stages: its leftovers ended as it ends, however it ends. It gives
    what ends them now, for a way out that does not come back through here (``os._exit``).
    ``new_only``: only what was started meanwhile (a run inside a flow of the user's, whose own
    processes are not the run's)."""
    before = existing() if new_only else frozenset()
    done: list[bool] = []

    def end() -> None:
        if done:
            return
        done.append(True)
        ended = end_leftovers(before=before)
        if ended:
            say(f"ended {len(ended)} process{'es' if len(ended) > 1 else ''} a task started and left running: "
                f"{', '.join(ended)} (a task waits for what it starts, or runs it as a cmd stage)")

    try:
        yield end
    finally:
        end()


def _any_children() -> bool:
    """Whether this process has a child, read from ``/proc`` without importing psutil (a run with nothing
    to do imports none of it); True where that cannot be read."""
    try:
        threads = os.listdir("/proc/self/task")
        return any(Path(f"/proc/self/task/{tid}/children").read_text().strip() for tid in threads)
    except OSError:
        return True


def _in(proc: psutil.Process, before: frozenset[tuple[int, float]]) -> bool:
    import psutil

    try:
        return (proc.pid, proc.create_time()) in before
    except psutil.Error:
        return False


def _environ(proc: psutil.Process) -> dict[str, str]:
    import psutil

    try:
        return dict(proc.environ())
    except psutil.Error:
        return {}


def _is_helper(proc: psutil.Process) -> bool:
    import psutil

    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(helper in line for helper in _HELPERS)


def _shown(proc: psutil.Process) -> str:
    import psutil

    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        line = "?"
    if "conveyor.cli.warm_runner" in line:  # a fork of a run a warm runner forked shows the runner's
        line = "forked by a task, without an exec"
    return f"{proc.pid} ({line[:60]}{'...' if len(line) > 60 else ''})"
