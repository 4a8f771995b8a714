"""A dvc.yaml project as its last load made it, kept between commands while nothing it was read
from has changed: ``validate``, ``dag`` and the rest do not have DVC parse and build 5,000
stages again for a pipeline nobody touched (4.6 s of every command at 5,000 stages).

What a load depends on is what it read, recorded while it ran (an audit hook,
:func:`sys.addaudithook`): every file opened for reading (dvc.yaml and dvc.lock files, ``.dvc``
files, params and vars files, DVC's config and ``.dvcignore`` files, whichever DVC's version
opens) and every folder listed (DVC's walk of the repository for its other DVC files: a file
added, removed or renamed in a folder changes the folder's mtime). Added to them: what loading
asks without opening or listing (the folders on the way to each stage's paths and wdir, where
conveyor looks for symbolic links leading out of the project) and what git reads in C (the
``.gitignore`` of each listed folder, ``.git/info/exclude``, the user's global ignore file).
A snapshot is used when every such file has the same bytes (sha256) and every such folder the
same mtime and inode, with the same conveyor code, DVC, pydantic and Python, and the same
``SHELL`` and ``DVC_*`` variables; anything else, or any doubt, loads the project as before.

A folder changed in the instant its stamp was taken (file systems keep mtimes in ticks: a few
milliseconds on Linux's, whole seconds on some network and FAT ones) cannot prove that no file
came after the listing: a load during which a recorded folder was modified keeps no snapshot.

Kept in the user's cache (``$CONVEYOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/conveyor``, else
``~/.cache/conveyor``), under ``projects/``, private to the user (0700), one file per dvc.yaml,
placement spec and ``-P``, at most :data:`KEEP` files (the least recently used go). Never in
the project: a snapshot is a pickle, and no file of a checkout may become code a command runs.
``CONVEYOR_SNAPSHOT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from conveyor.spec.project import Project

KEEP = 32  # snapshots kept per user
FORMAT = 1
FOLDERS_OF_STATE = (".conveyor", ".git", os.path.join(".dvc", "tmp"), os.path.join(".dvc", "cache"))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# mtimes in whole seconds (FAT, some network file systems, ext3): a folder is trusted 2 s after a change
COARSE_S, FINE_S = 2.0, 0.05


def cache_dir() -> Path:
    found = os.environ.get("CONVEYOR_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(found) if found else Path.home() / ".cache"
    return (base if os.environ.get("CONVEYOR_CACHE_DIR") else base / "conveyor") / "projects"


def enabled() -> bool:
    return os.environ.get("CONVEYOR_SNAPSHOT", "1") != "0"


class _Reads:
    """The files opened for reading and the folders listed while a load runs: by any thread of
    the process (what another thread read too only makes the snapshot more careful)."""

    active: ClassVar[list[_Reads]] = []
    hooked: ClassVar[bool] = False

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.folders: set[str] = set()
        self.lost = False  # a read could not be noted: nothing is kept

    @classmethod
    def hook(cls, event: str, args: tuple[Any, ...]) -> None:
        if not cls.active:
            return
        try:
            cls._note(event, args)
        except Exception:  # noqa: BLE001 - an audit hook never fails what it audits (a deleted cwd, a bad name)
            for reads in list(cls.active):
                reads.lost = True

    @classmethod
    def _note(cls, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (flags or 0) & _WRITE_FLAGS if mode is None else any(c in str(mode) for c in "wax+")
            if isinstance(path, (str, bytes, os.PathLike)) and not writes:
                for reads in list(cls.active):
                    reads.files.add(os.path.abspath(os.fsdecode(path)))
        elif event in ("os.listdir", "os.scandir") and isinstance(args[0], (str, bytes, os.PathLike)):
            for reads in list(cls.active):
                reads.folders.add(os.path.abspath(os.fsdecode(args[0])))


_hooking = threading.Lock()


@contextlib.contextmanager
def recording() -> Iterator[_Reads]:
    """What the process opens and lists inside the block."""
    with _hooking:
        if not _Reads.hooked:
            sys.addaudithook(_Reads.hook)
            _Reads.hooked = True
        reads = _Reads()
        _Reads.active = [*_Reads.active, reads]
    try:
        yield reads
    finally:
        with _hooking:
            _Reads.active = [r for r in _Reads.active if r is not reads]


def digest(path: str) -> str | None:
    """The sha256 of a file's bytes; None when it is absent or unreadable; what it is otherwise."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO would block
            return "folder" if stat.S_ISDIR(st.st_mode) else f"mode {st.st_mode:o}"
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_mtime_ns, st.st_ino) if stat.S_ISDIR(st.st_mode) else (-1, st.st_ino)


def _file_stamp(path: str) -> tuple[int, int] | None:
    try:
        return os.stat(path).st_mtime_ns, 0
    except OSError:
        return None


def _code_stamp() -> str:
    """conveyor's own modules (an edited checkout of conveyor loads anew) and its libraries."""
    from importlib.metadata import version

    package = Path(__file__).resolve().parent.parent
    found = hashlib.sha256()
    for folder, dirs, files in os.walk(package):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                found.update(f"{folder}/{name} {st.st_mtime_ns} {st.st_size}\n".encode())
    found.update(f"{version('dvc')} {version('pydantic')} {sys.version} {FORMAT}".encode())
    env = sorted((k, v) for k, v in os.environ.items()  # what chooses the shell and DVC's config files
                 if k.startswith("DVC_") or k in ("SHELL", "HOME", "XDG_CONFIG_HOME"))
    found.update(repr(env).encode())
    return found.hexdigest()


def _excluded(root: Path) -> Callable[[str], bool]:
    """What a load reads that is not the project's: conveyor's, git's and DVC's state in the
    project, Python's own files (modules imported on the way), the kernel's."""
    inside = [os.path.join(str(root), f) + os.sep for f in FOLDERS_OF_STATE]
    outside = [p.rstrip(os.sep) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}
               if p and not str(root).startswith(p.rstrip(os.sep) + os.sep) and p != str(root)]
    outside += ["/proc/", "/sys/", "/dev/"]
    return lambda path: any(path.startswith(p) for p in inside + outside)


def _on_the_way(root: Path, paths: Iterable[str]) -> set[str]:
    """The folders from ``root`` down to each path (relative to it), as far as they exist."""
    folders = {str(root)}
    for rel in paths:
        here = root
        for part in Path(rel).parts[:-1]:
            here = here / part
            if not here.is_dir():
                break
            folders.add(str(here))
    return folders


def _git_ignores(root: Path, folders: Iterable[str]) -> list[str]:
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [*(os.path.join(f, ".gitignore") for f in folders), str(root / ".git" / "info" / "exclude"),
            str(root / ".git" / "config"), str(Path.home() / ".gitconfig"), str(config / "git" / "ignore")]


class Snapshot:
    """The snapshot of one dvc.yaml's project (``placement``: the spec that places its stages;
    ``everything``: loaded as ``dvc repro -P``)."""

    def __init__(self, dvc_file: Path, placement: Path | None, everything: bool) -> None:
        key = f"{dvc_file}\0{placement}\0{everything}"
        self.path = cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pickle"
        self.key = key

    def load(self) -> Project | None:
        """The project as the snapshot holds it, or None (none, or anything it was read from changed)."""
        from conveyor.spec.project import Project

        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    return None
                header = pickle.load(f)  # noqa: S301 - the user's own file (owner and mode checked)
                if header.get("key") != self.key or header.get("code") != _code_stamp():
                    return None
                if any(digest(p) != h for p, h in header["files"].items()) or \
                        any(_stamp(p) != s for p, s in header["folders"].items()):
                    return None
                fields = pickle.load(f)  # noqa: S301 - as above
            os.utime(self.path)  # recently used
            project = Project(**fields)
            if project.dvc is not None:
                project = dataclasses.replace(project, dvc=dataclasses.replace(project.dvc, inputs=header["files"]))
            return project
        except Exception:  # noqa: BLE001 - absent, partly written, from another version: load the project
            return None

    def keep(self, project: Project, reads: _Reads, started_ns: int) -> dict[str, str | None] | None:
        """Keep ``project`` as loaded from what ``reads`` saw, unless a folder changed during the load;
        returns the bytes' digests of the files it was read from (None: not kept)."""
        from conveyor.spec.project import Project

        if reads.lost:
            return None
        root = project.root
        skip = _excluded(root)
        paths = [p for s in project.pipeline.stages.values() for p in [*s.deps, *s.written, s.wdir or "."]
                 if "://" not in p]
        folders = {f for f in reads.folders if not skip(f + os.sep)} | _on_the_way(root, paths)
        stamps = {f: _stamp(f) for f in sorted(folders)}
        ticks = [s[0] for s in stamps.values() if s is not None]
        window = COARSE_S if any(t % 1_000_000_000 == 0 for t in ticks) else FINE_S
        if any(t >= started_ns - window * 1e9 for t in ticks):
            return None  # a folder changed while it was read (or too recently to tell)
        files = sorted({f for f in reads.files if not skip(f)} | set(_git_ignores(root, folders)))
        if project.spec_path.name != "dvc.yaml":
            files.append(str(project.spec_path))
        digests = {p: digest(p) for p in files}  # first the bytes, then whether they changed during the load
        if any(t >= started_ns - window * 1e9 for t in [s[0] for s in map(_file_stamp, files) if s is not None]):
            return None
        fields = {f.name: getattr(project, f.name) for f in dataclasses.fields(Project) if f.init}
        if project.dvc is not None:
            fields["dvc"] = dataclasses.replace(project.dvc, loaded=None, _files={}, inputs=None)
        header = {"key": self.key, "code": _code_stamp(), "files": digests,
                  "folders": stamps}
        try:
            self._write(pickle.dumps(header, protocol=5) + pickle.dumps(fields, protocol=5))
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            return None  # a read-only home, a full disk: the next command loads the project, as without one
        return digests

    def _write(self, data: bytes) -> None:
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        scratch = folder / f".{self.path.name}.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(scratch, self.path)
        finally:
            scratch.unlink(missing_ok=True)
        kept = sorted(folder.glob("*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)


def loaded(dvc_file: Path, placement: Path | None, everything: bool, load: Callable[[], Project]) -> Project:
    """The project of ``dvc_file``: the snapshot's when nothing it was read from changed, else
    ``load()``'s (kept for the next command)."""
    if not enabled():
        return load()
    snapshot = Snapshot(dvc_file, placement, everything)
    found = snapshot.load()
    if found is not None:
        return found
    started = time.time_ns()
    with recording() as reads:
        project = load()
    inputs = snapshot.keep(project, reads, started)
    if inputs is None or project.dvc is None:
        return project
    return dataclasses.replace(project, dvc=dataclasses.replace(project.dvc, inputs=inputs))
