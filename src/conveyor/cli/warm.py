"""The ``conveyor`` command's entry: a run handed to a warm runner, else run here as before.

A run that forces one trivial stage spent most of its time importing Prefect (0.7 s), DVC and
their dependencies (1 s of a 1.6 s run on 2 cores), while ``dvc repro -s -f`` takes 0.5 s in
all. So a ``conveyor run`` or ``exec`` that finds no **warm runner** starts one
(:mod:`conveyor.cli.warm_runner`): a process that imports those libraries once and forks a child
for each run of the same environment, this first one included (its imports are the ones this
process would have done: the first run costs no more, every later one goes straight to the
pipeline, importing conveyor anew only if its files changed since the runner imported them). A
runner that is up also
serves the short commands that read the project (:data:`SERVED`: ``status``, ``validate``...);
they start none. What a run does is
unchanged: the child is given this process's arguments, working directory, environment, umask
and its standard input, output and error themselves (the descriptors, passed over a Unix
socket), so terminals, pipes and redirections behave as they would here. This process stays
as the run's stand-in: it forwards Ctrl-C, ``kill``, a closed terminal (SIGHUP), Ctrl-Z and a
resized window to the child, and exits with the child's code (or dies of the child's signal).
Killed itself, even by ``kill -9``, its child is killed at once (SIGKILL, as the run would have
been).

A runner serves only runs that a fresh process would run exactly as it does: the same Python,
``sys.path``, flags, user, groups, CPU set, resource limits, namespaces and cgroup, the same
installed packages (the modification times of every ``sys.path`` folder: an install or upgrade
changes them) and the same environment but for variables that only describe the terminal or
shell (:data:`VOLATILE`), and those named in ``CONVEYOR_WARM_IGNORE`` (comma-separated: what
only the tasks read, as they run, e.g. a CI job's id). Anything else gets a runner of its own; at
most :data:`conveyor.cli.warm_runner.MAX_RUNNERS` are kept per ``PREFECT_HOME``. A runner starts
with the environment of the run that started it less those variables (it imports with them
unset; each child gets its own client's). It runs on Linux (abstract Unix sockets,
``SO_PEERCRED``: only the same user is served), is found by a name derived from all of the
above, and ends ``CONVEYOR_WARM_IDLE`` seconds after its last run (by default the kept Prefect
server's idle time, ``CONVEYOR_SERVER_IDLE``: 900); ``conveyor server status`` lists it and
``conveyor server stop`` stops it. ``CONVEYOR_WARM=0`` (or an idle time of 0) runs every command
here, as before.

Standard library only, and no import of conveyor beyond this package: the hand-over is on every run's path.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import resource
import signal
import socket
import struct
import sys
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from types import FrameType

PROTOCOL = 3  # of the hand-over, part of the key: a runner of another conveyor is not asked (2: READY; 3: orig_argv)
# What a deterministic stage's task is handed over as (conveyor.cli.warm_task.task), never by `conveyor`
TASK = "_task"
COMMANDS = frozenset({"run", "exec", TASK})  # the commands that import Prefect (or a task's libraries): learning
# Short commands that only read the project (or write dvc.yaml): a runner that is up serves them
# too (``conveyor status``: 0.1 CPU-s instead of 0.45, 0.15 s instead of 0.3), none starts one.
# Not the long-lived ones (servers, predict, search: their own processes' lives) nor ``server``,
# which stops the runners.
SERVED = COMMANDS | {"status", "validate", "compile", "dag", "logs", "runs", "compare", "schema"}
# Variables that describe the shell or the terminal a command was typed in, the stage and the
# experiment that DVC runs it for (``conveyor exec`` under ``dvc repro`` or ``dvc exp run``: each
# experiment has its own name and baseline, so without them every experiment started a runner
# that never served) or the tool timing it, not what the libraries read as they load; the child
# gets the client's values all the same.
VOLATILE = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "WINDOWID", "TERM_SESSION_ID",
                      "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "TMUX_PANE", "PS1", "PROMPT_COMMAND",
                      "HISTFILE", "HISTSIZE", "HISTCONTROL", "LS_COLORS", "GPG_TTY", "DVC_STAGE", "DVC_ROOT",
                      "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "HYPERFINE_RANDOMIZED_ENVIRONMENT_OFFSET",
                      "CONVEYOR_STAGE", "CONVEYOR_RUN_ID", "CONVEYOR_CHECKPOINT_DIR",
                      "CONVEYOR_OUTLIVES"})  # conveyor.run.leftovers.OUTLIVES: a runner's own, naming who started it
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGCONT)
# What ends a process by default: received before the runner has forked the run, it ends this one
ENDING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2})
STARTED_WITH: dict[str, str] = {}  # the environment this command started with (a warm runner's child: its client's)
# The client's pid, set by a runner's child for the fresh ``conveyor`` it execs itself into
# (conveyor.cli.warm_child), which runs the command itself and unsets it: the environment is the client's
ANEW = "CONVEYOR_WARM_ANEW"
READY = b"R"  # a runner's first byte on a connection: it takes the command now
HEADER = struct.Struct("!I")
EVENT = struct.Struct("!cq")  # b"P" + the child's pid, then b"X" + its wait status
_LIMITS = ("RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_MEMLOCK",
           "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_STACK")


def main() -> None:
    """``conveyor``: hand a command of :data:`SERVED` to a warm runner when one serves this environment
    (for ``run`` and ``exec``, to one started for it where none does); otherwise run it in this process."""
    anew = os.environ.pop(ANEW, "")  # a runner's child that could not be the command: it is, fresh
    STARTED_WITH.update(os.environ)
    if sys.argv[1:2] and sys.argv[1] in SERVED and (problem := idle_problem()):
        print(problem, file=sys.stderr)  # as a bad CONVEYOR_SERVER_IDLE: not a silent run without runners
        sys.exit(2)
    key = eligible(sys.argv[1:]) if standard_fds_open() and not anew and sys.argv[1:2] != [TASK] else None
    if key is not None:
        handed_over(key, sys.argv[1:])  # returns only when no runner took the command
        if sys.argv[1] in COMMANDS and spawn(key):
            handed_over(key, sys.argv[1:])  # the new runner forks this run once its imports end
    if anew.isdigit():
        from conveyor.workspace import stand_in

        stand_in(int(anew))  # as the child would have: the run lock names the command the user started
    from conveyor.cli.app import main as run_here

    run_here()


def eligible(args: list[str], leave: frozenset[str] = frozenset()) -> str | None:
    """The runner key for ``args`` (:func:`key`), or None when the command runs here (not one a runner serves,
    not Linux, turned off)."""
    if not args or args[0] not in SERVED or not serving():
        return None
    try:
        return key(leave)
    except OSError:
        return None


def serving() -> bool:
    """Whether runners serve here: on Linux, not turned off (``CONVEYOR_WARM=0``, an idle time of 0)."""
    return sys.platform == "linux" and os.environ.get("CONVEYOR_WARM", "").strip() != "0" and idle_s() is not None


def idle_s() -> float | None:
    """How long a runner waits unused: ``CONVEYOR_WARM_IDLE`` where set, else ``CONVEYOR_SERVER_IDLE`` (900
    unset), in seconds; None for 0 or a value that is not a number of seconds (no runner)."""
    raw = os.environ.get("CONVEYOR_WARM_IDLE", "").strip() or os.environ.get("CONVEYOR_SERVER_IDLE", "").strip()
    try:
        value = float(raw) if raw else 900.0
    except ValueError:
        return None
    return value if 0 < value < 10**7 else None


def idle_problem() -> str | None:
    """What is wrong with ``CONVEYOR_WARM_IDLE``, in the words of a usage error; None when it is unset or
    a number of seconds."""
    raw = os.environ.get("CONVEYOR_WARM_IDLE", "").strip()
    try:
        if not raw or 0 <= float(raw) < 10**7:
            return None
    except ValueError:
        pass
    return (f"CONVEYOR_WARM_IDLE={raw!r}: give the seconds a warm runner waits unused before it ends "
            "(0: no runners)")


def key(leave: frozenset[str] = frozenset()) -> str:
    """What a fresh ``conveyor`` process would depend on, hashed: a runner serves one key only. ``leave``:
    variables left out too (what the run that started a task had set itself: :func:`task_start`)."""
    env = sorted(lasting_environ(os.environ, leave).items())
    limits = [resource.getrlimit(getattr(resource, name)) for name in _LIMITS if hasattr(resource, name)]
    namespaces = [_readlink(f"/proc/self/ns/{ns}") for ns in ("mnt", "pid", "net", "user", "ipc", "uts")]
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            cgroup = f.read()
    except OSError:
        cgroup = ""
    installed = [_mtime(entry) for entry in sys.path]
    parts = [PROTOCOL, sys.executable, sys.version, repr(sys.flags), sorted(sys._xoptions.items()), sys.path, installed,
             os.getuid(), os.geteuid(), os.getgid(), sorted(os.getgroups()), sorted(os.sched_getaffinity(0)),
             limits, namespaces, cgroup, env]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def lasting_environ(env: Mapping[str, str], leave: AbstractSet[str] = frozenset(),
                    keep: AbstractSet[str] = frozenset()) -> dict[str, str]:
    """``env`` less what a runner may differ in: :data:`VOLATILE`, ``CONVEYOR_WARM_IGNORE``'s names but those in
    ``keep``, and those in ``leave``."""
    named = {name.strip() for name in env.get("CONVEYOR_WARM_IGNORE", "").split(",")} - keep
    return {k: v for k, v in env.items() if k not in VOLATILE and k not in named and k not in leave}


def address(runner_key: str) -> str:
    """The runner's abstract socket name (no file: nothing to clean up, nothing left by a kill -9)."""
    return f"\0conveyor-warm-{os.getuid()}-{runner_key}"


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _mtime(entry: str) -> int:
    try:
        return os.stat(entry or ".").st_mtime_ns
    except OSError:
        return 0


class _Abandoned(Exception):
    """A signal of :data:`ENDING` came while the command waited for the runner to fork it."""


class _Forwarder:
    """This process's signals, passed on to the child once its pid is known (queued until then)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.previous: dict[int, signal._HANDLER] = {}  # to put back when no runner took the command
        self.waiting = False  # for the runner to fork the child (it may be importing still: a first run)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTSTP:  # Ctrl-Z: stop the child (its session ignores SIGTSTP), then this process
            self.send(signal.SIGSTOP)
            signal.signal(signal.SIGTSTP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTSTP)
            signal.signal(signal.SIGTSTP, self)
            return
        self.send(signum)
        if self.waiting and self.pid is None and signum in ENDING:
            self.waiting = False  # once: a second signal meanwhile is only pending
            raise _Abandoned  # nothing runs yet: this process ends of it now (the runner kills what it forks)

    def send(self, signum: int) -> None:
        if self.pid is None:
            self.pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self.send(signum)
        self.pending.clear()


def handed_over(runner_key: str, args: list[str]) -> None:
    """Give the command to the runner of ``runner_key`` and exit as its child does; return when no
    runner took it (none runs, it is stopping), having started nothing.

    The runner accepts a connection only when it can fork at once (one that has just started imports
    first: the command waits in its queue), and says so (:data:`READY`) before the command sends its
    descriptors: a command abandoned while it waits (Ctrl-C) has given away none of them. (A runner
    that learned libraries from its runs imports them once it has a ``run``'s request: a command
    abandoned then ends as well, and the runner closes what it was sent and forks nothing.)"""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    forward = _Forwarder()
    try:
        conn.connect(address(runner_key))
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if peer[1] != os.getuid():  # the name is taken by another user's process: not ours to use
            raise PermissionError("another user's runner")
        for signum in (*FORWARDED, signal.SIGTSTP):
            forward.previous[signum] = signal.signal(signum, forward)
        forward.waiting = True  # from now on a signal of ENDING raises; one that came before is pending
        if ENDING.intersection(forward.pending):
            raise _Abandoned
        if conn.recv(1) != READY:  # closed: the runner stopped, or would not serve after its imports
            raise ConnectionError("the runner took no command")
        umask = os.umask(0o022)
        os.umask(umask)
        request = json.dumps({"argv": [sys.argv[0], *args], "cwd": os.getcwd(), "env": dict(os.environ),
                              "umask": umask, "path": sys.path, "orig_argv": sys.orig_argv}).encode()
        conn.sendmsg([HEADER.pack(len(request))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
        conn.sendall(request)
        _wait(conn, forward)
    except (OSError, _Abandoned):
        if forward.pid is not None:  # a child runs the command: whatever failed here, it is never run again
            _lost(forward.pid)
    _not_taken(conn, forward)


def _wait(conn: socket.socket, forward: _Forwarder) -> None:
    """Follow the child: its pid, then its end; this process ends the same way. Returns (nothing
    started) when the runner closed the connection before a child was forked."""
    buffer = b""
    while True:
        try:
            chunk = conn.recv(EVENT.size - len(buffer))
        except OSError:
            chunk = b""
        if not chunk:
            break
        buffer += chunk
        if len(buffer) < EVENT.size:
            continue
        kind, value = EVENT.unpack(buffer)
        buffer = b""
        if kind == b"P":
            forward.started(value)
        elif kind == b"X":
            _end_as(int(value))
    if forward.pid is not None:
        _lost(forward.pid)


def _lost(pid: int) -> None:
    """The child's end cannot be known here (its runner went): exit 1 saying so."""
    print(f"conveyor: the warm runner ended during the run (child pid {pid} was killed with it): run "
          "again, or set CONVEYOR_WARM=0 to run without one", file=sys.stderr)
    os._exit(1)


def _not_taken(conn: socket.socket, forward: _Forwarder) -> None:
    """Nothing was forked for this command: it runs here, or ends of the signal that came meanwhile."""
    forward.waiting = False
    _restore_signals(forward)
    conn.close()  # a child the runner forks now is killed at once: its client is gone
    for signum in forward.pending:  # Ctrl-C or kill before anything started: this process takes it
        if signum in ENDING:  # and ends of it, as a run that has not started would
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _end_as(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # the child died of a signal: so does this process, as the shell would have seen it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those take no handler: signal.signal raises
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def standard_fds_open() -> bool:
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


def _restore_signals(forward: _Forwarder) -> None:
    for signum, handler in forward.previous.items():
        signal.signal(signum, handler)


def spawn(runner_key: str) -> bool:
    """Start the runner of ``runner_key`` and wait until it has claimed its name and listens (before its
    imports: this command, handed over next, waits in its queue and is forked once they end; a run
    started meanwhile waits there too): True then, or when it found the name taken (a runner another
    run started: the hand-over tries that one). False, silently, where it could not be started or did
    not listen within :data:`SPAWN_WAIT_S`: the command runs here, as without runners."""
    return start_runner([sys.executable, "-c", _SERVE, runner_key, json.dumps(sys.path)], lasting_environ(os.environ))


def start_runner(argv: list[str], env: dict[str, str]) -> bool:
    """:func:`spawn`'s start of a runner, given as its last argument the end of a pipe it closes once it listens."""
    import select
    import subprocess

    from conveyor.run.leftovers import outliving  # off every run's path: a runner starts once

    try:
        read, write = os.pipe()  # the runner closes its end once it listens (or ends)
        try:
            subprocess.Popen([*argv, str(write)], pass_fds=(write,), cwd="/", env=outliving(env),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        finally:
            os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], SPAWN_WAIT_S)
            return bool(ready) and not os.read(read, 1)
        finally:
            os.close(read)
    except OSError:
        return False


# sys.path first, as this process has it: the runner imports what this process would
_SERVE = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
          "from conveyor.cli.warm_runner import serve; serve(sys.argv[1], int(sys.argv[3]))")
SPAWN_WAIT_S = 10.0  # for a new runner to listen: 0.1 s on 2 cores (Python's start and 70 ms of imports)
