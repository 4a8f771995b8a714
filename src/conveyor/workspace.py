"""``.conveyor/``: conveyor's own state in a project, and the lock that makes runs one at a time.

It holds the run records (``runs/``), the stages' logs (``logs/``), the outs journal
(``journal/``), conveyor's fingerprint record for specs DVC does not run (``locks/``) and
the run lock. Like ``.dvc/tmp``, none of it belongs in git: the folder ignores itself.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conveyor.errors import UNWRITABLE, RunLockedError, UnwritableError

STATE_DIR = ".conveyor"


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a write the file system refuses (read-only, full) into an :class:`UnwritableError`
    naming ``path``: a write that fails mid-way (ENOSPC) raises an OSError that names no file."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, UnwritableError) or exc.errno not in UNWRITABLE:
            raise
        raise UnwritableError.of(exc, path) from exc


def state_dir(root: Path) -> Path:
    """``root/.conveyor``, made on first use with a ``.gitignore`` that ignores all of it."""
    folder = root / STATE_DIR
    ignore = folder / ".gitignore"
    if not ignore.exists():
        with writing(ignore):
            folder.mkdir(parents=True, exist_ok=True)
            ignore.write_text("# conveyor's run records, logs and journal: local state, not for git\n*\n",
                              encoding="utf-8")
    return folder


def replace_atomically(path: Path, text: str, scratch: Path | None = None, *, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or a
    process killed mid-write) sees the old content or the new, never a part.

    ``scratch``: where the temporary file goes (default: beside ``path``), e.g. ``.conveyor/``
    for a file in the user's tree, where a kill -9 would otherwise leave it in plain sight.
    It must be on the same file system; where it is not, the file goes beside ``path``.
    ``durable``: the text is on disk (fsync) before the rename, so it survives a power loss too.
    The temporary files of ``path`` that killed writers left behind go first.
    """
    folder = scratch if scratch is not None else path.parent
    with writing(path):
        folder.mkdir(parents=True, exist_ok=True)
        _write_then_rename(path, text, folder, scratch, durable=durable)


def _write_then_rename(path: Path, text: str, folder: Path, scratch: Path | None, *, durable: bool) -> None:
    """The body of :func:`replace_atomically`; a full disk leaves no temporary file behind."""
    _remove_stale_temporaries(folder, path.name)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV or scratch is None:
                raise
            replace_atomically(path, text, durable=durable)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale_temporaries(folder: Path, name: str) -> None:
    """The temporary files of ``name`` that writers killed mid-write left in ``folder`` (their
    process is gone: the pid in the name says whose it was)."""
    for stale in folder.glob(f".{glob.escape(name)}.*.tmp"):
        pid = stale.name[len(name) + 2:-len(".tmp")]
        if pid.isdigit() and not alive(int(pid)):
            stale.unlink(missing_ok=True)


def _dvc_above(pid: int, depth: int = 4) -> str | None:
    """``dvc repro (pid 123)`` when a DVC command is ``pid`` or one of its nearest ancestors (Linux'
    /proc); None otherwise or where it cannot be seen."""
    for _ in range(depth):
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        except OSError:
            return None
        program = next((i for i, arg in enumerate(argv[:3]) if os.path.basename(arg) == "dvc"), None)
        if program is not None:
            return f"{' '.join(['dvc', *argv[program + 1:program + 2]])} (pid {pid})"
        pid = int(stat[stat.rfind(")") + 2:].split()[1])  # after "pid (comm) state": the parent
        if pid <= 1:
            return None
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's included)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


_COMMAND: list[int] = []  # a warm runner's child: the pid of the `conveyor` command it runs for


def command_pid() -> int:
    """The pid that names this run to the user (in the run lock, a kept server's lease): this
    process's, or, for a run a warm runner forked (conveyor.cli.warm), the ``conveyor`` command's
    that handed it over and stands in for it (a signal sent to it reaches the run; a DVC command
    above it is what ran it). Liveness is never judged by it: locks are, held by the run itself."""
    return _COMMAND[0] if _COMMAND else os.getpid()


def stand_in(pid: int) -> None:
    """This process runs for the ``conveyor`` command ``pid`` (set by a warm runner's child)."""
    _COMMAND[:] = [pid]


def run_holder(root: Path) -> int | None:
    """The pid of the process that holds the project's run lock now (0 where it wrote none);
    None when no one does. Only reads, so a read-only checkout can ask too."""
    try:
        fh = (root / STATE_DIR / "run.lock").open("r")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = fh.read().strip()
            return int(holder) if holder.isdigit() else 0
        fcntl.flock(fh, fcntl.LOCK_UN)
        return None


_HELD: set[int] = set()  # the descriptors of the locks this process holds for a run


@contextmanager
def kept_from_forks(fd: int) -> Iterator[None]:
    """While this process holds a lock on ``fd`` (a flock: the run lock, DVC's), a child it forks
    without an exec does not keep it (:func:`_not_in_forks`)."""
    _HELD.add(fd)
    try:
        yield
    finally:
        _HELD.discard(fd)


def _not_in_forks() -> None:
    """In a child forked without an exec (a task's ``multiprocessing`` fork): the run's locks are its
    parent's. A flock belongs to the open file, which the child's copy of the descriptor keeps
    open: were the parent killed, the project would stay locked for as long as the child lives. The
    copy is pointed at /dev/null (not closed: its number stays the file object's in the child)."""
    if not _HELD:
        return
    try:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        for fd in _HELD:
            os.dup2(null, fd, inheritable=False)
        os.close(null)
    except OSError:
        pass
    _HELD.clear()


os.register_at_fork(after_in_child=_not_in_forks)


@contextmanager
def run_lock(root: Path) -> Iterator[None]:
    """Hold the project's run lock; a second concurrent run fails at once with a clear message.
    A process forked from this one (without an exec) does not hold it (:func:`_not_in_forks`)."""
    path = state_dir(root) / "run.lock"
    with writing(path):
        fh = path.open("a+")
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            pid = int(holder) if holder.isdigit() else None
            dvc = _dvc_above(pid) if pid is not None else None
            if dvc is not None:  # `conveyor exec`, as dvc repro runs a stage
                raise RunLockedError(f"DVC is running in {root} ({dvc}, running a stage with `conveyor exec`, "
                                     f"pid {holder}): wait for it to finish, then run again", pid) from None
            raise RunLockedError(f"another conveyor run holds {path} (pid {holder}); wait for it "
                                 "to finish, then run again", pid) from None
        with writing(path):  # unbuffered: a full disk fails here, naming the lock, not as the file closes
            fh.seek(0)
            fh.truncate()
            os.write(fh.fileno(), str(command_pid()).encode())
        try:
            with kept_from_forks(fh.fileno()):
                yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)
