"""The guard of one ``cmd`` stage: runs its commands, and takes them down with the runner.

Started by :mod:`conveyor.run.commands` as ``python -I -S guard.py 2 /bin/sh -c CMD [CMD ...]``
(the number of words of the shell, the shell, then each command) in a new session, so the
guard, the shell and everything the commands start share one process group that the runner
can signal as a whole (a timeout, Ctrl-C). The guard's stdin is a pipe whose other end only
the runner holds: when the runner dies, even by kill -9, the kernel closes it, and the guard,
which waits on it and on the command (:func:`_wait`), reads end-of-file and kills the whole
group. Commands run one after another, as DVC runs a list ``cmd``; the first that fails ends
the stage.

A process that leaves the group (``setsid server &``, a daemon's double fork: what
``mlflow server &`` or ``tensorboard &`` do) is still the guard's: on Linux the guard is a
child subreaper (``PR_SET_CHILD_SUBREAPER``), so an orphaned descendant becomes its child
instead of init's. When the commands end the guard stops every process still under it;
when the runner kills the group it first lists the guard's descendants (:func:`descendants`)
and signals those that left the group too. Elsewhere (no ``/proc``, no prctl) only the
process group is covered.

Standard library only, and no import of conveyor: every ``cmd`` stage waits for it to start.
Without ``site`` (``-S``), and without json, subprocess, threading, contextlib or signal (which
import re, enum, collections, selectors: the signal numbers come from ``_signal``, the module
under ``signal``), it starts in about 9 ms on 2 cores, 5 of them the interpreter's own start:
it took 19. It starts each command with a plain fork and exec, from its only thread, as
``subprocess`` would; not with ``posix_spawn``, after which glibc leaves its own two real-time
signals ignored in the command.
"""

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False  # not typing's: it would take as long to import as the rest
if TYPE_CHECKING:
    import signal
else:
    import _signal as signal  # the numbers, without signal's enums

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
ESCAPED_GRACE_S = 2.0  # between SIGTERM and SIGKILL of what the commands left running


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, walked down from it through ``/proc`` ([] without /proc)."""
    scanned: dict[int, list[int]] | None = None
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        if _CHILDREN_LISTED:
            children = _children(parent)
        else:
            scanned = _scan() if scanned is None else scanned
            children = scanned.get(parent, [])
        for child in children:
            if _state(child) not in (None, b"Z"):  # a zombie has ended: only its parent's wait is missing
                found.append(child)
                todo.append(child)
    return found


# Linux lists each thread's children in /proc (3.5 and later, CONFIG_PROC_CHILDREN): a walk from
# the root reads a few files; without it every process's parent link is read
_CHILDREN_LISTED = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(child) for child in f.read().split()]
    except OSError:  # it (or that thread) ended since listed
        pass
    return found


def _scan() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return children
    for pid in entries:
        parent = _parent(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    return children


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)``: state, ppid, ...; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def _state(pid: int) -> bytes | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:  # noqa: SIM105  # not contextlib.suppress: see the imports
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # noqa: SIM105
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def _stop_left_running() -> None:
    """SIGTERM what the commands left running under the guard, SIGKILL it after a grace, reap it."""
    left = descendants(os.getpid())
    if left:
        named = "; ".join(f"pid {pid}: {_command_line(pid)}" for pid in left)
        print(f"conveyor: stopping {len(left)} process(es) the stage's commands left running ({named})",
              file=sys.stderr, flush=True)
        signal_all(left, signal.SIGTERM)
    kill_after = time.monotonic() + ESCAPED_GRACE_S
    while left:
        _reap_children()
        time.sleep(0.02)
        left = descendants(os.getpid())
        if left and time.monotonic() > kill_after:
            signal_all(left, signal.SIGKILL)
    _reap_children()


def _reap_children() -> None:
    """Collect the exit status of ended children (orphans the guard adopted as subreaper)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def pidfd(pid: int) -> int | None:
    """A descriptor of child ``pid`` that polls readable once it has exited (close-on-exec, as
    every pidfd); None where Linux offers none (before 5.3, or refused)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _runner_gone() -> None:
    """The runner's end of stdin closed: kill this process group and what left it."""
    signal_all(descendants(os.getpid()), signal.SIGKILL)
    os.killpg(0, signal.SIGKILL)


def _call(argv: list[str]) -> int:
    """Run ``argv`` as ``subprocess.call(argv, stdin=DEVNULL)`` would: found on PATH, standard
    input from /dev/null, SIGPIPE and SIGXFSZ back to their default (Python ignores them), no
    descriptor but 0-2 (Python opens its own close-on-exec); its exit status, -N for signal N
    (127 when it cannot be started, as a shell says). Interrupted while waiting, the command is
    killed, as ``subprocess.call`` kills it."""
    pid = os.fork()
    if pid == 0:  # the command's process, until exec
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            for name in ("SIGPIPE", "SIGXFSZ"):
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
            os.execvp(argv[0], argv)  # noqa: S606  # the stage's shell, as DVC starts it
        except BaseException as exc:  # noqa: BLE001  # nothing may return into the guard's code
            os.write(2, f"conveyor: cannot run {argv[0]}: {exc}\n".encode(errors="replace"))
        finally:
            os._exit(127)
    try:
        return _wait(pid)
    except BaseException:
        signal_all([pid], signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


def _wait(pid: int) -> int:
    """The exit status of ``pid``, waiting on it (a pidfd; else every 50 ms) and on stdin at once:
    the runner gone, the group is killed and this never returns."""
    exits = pidfd(pid)
    waiting = select.poll()
    waiting.register(0, select.POLLIN)
    if exits is not None:
        waiting.register(exits, select.POLLIN)
    try:
        while True:
            for fd, _ in waiting.poll(None if exits is not None else 50):
                if fd == 0:
                    try:
                        if not os.read(0, 4096):
                            _runner_gone()
                    except OSError:
                        _runner_gone()
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
    finally:
        if exits is not None:
            os.close(exits)


def main(argv: list[str]) -> int:
    words = int(argv[1])
    shell, commands = argv[2:2 + words], argv[2 + words:]
    _become_subreaper()
    try:
        for command in commands:
            code = _call([*shell, command])
            if code != 0:
                return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
        return 0
    finally:
        _stop_left_running()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
