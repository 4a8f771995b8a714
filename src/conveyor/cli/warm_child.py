"""A warm runner's child (:mod:`conveyor.cli.warm_runner`): the command's own process, as a fresh one.

Forked with Prefect, DVC and conveyor's commands imported, it takes the client's standard
descriptors, directory, umask, environment, ``argv`` and ``sys.path``, keeps conveyor's modules
only while every file they were read from is as it was then (else it drops them all: conveyor's
code is read from disk anew; an edit of an editable install counts), sets up again what the
libraries and conveyor set up as they were imported in the runner (:func:`_libraries_here`),
runs ``conveyor.cli.app.main`` and exits as the interpreter would (threads joined, exit handlers
run). It dies with the runner. Where the project holds a module named like a library the runner
has imported for its runs (learned from another project's), the child cannot be what a fresh
process would be: it execs a fresh ``conveyor`` in its place (:func:`_anew_if_shadowed`).

Kept, conveyor's modules are what a fresh process would have: the runner imports them and runs
nothing, and the child differs from a fresh process only in what an import reads of the process
(its directory, the terminal, the variables of :data:`conveyor.cli.warm.VOLATILE`). Of
conveyor's modules only :mod:`conveyor.cli.common` reads any (its consoles detect the terminal):
renewed here; ``tests/test_architecture.py`` keeps it so. Keeping them saves a run 45 ms (87
modules imported again).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from conveyor.cli.warm import ANEW, STARTED_WITH, TASK

# What Prefect's settings were read from when the runner imported it (in /): the profiles file's
# stat, and whether a settings file was there. A child in a directory with no settings file of
# its own, the profiles file unchanged, has those settings already (the environment is the same).
SETTINGS_READ: list[tuple[object, bool]] = []
# The file of every conveyor module the runner imported, with its signature then (see _signature).
IMPORTED: dict[str, tuple[int, int, int, int] | None] = {}
# The data libraries a runner imports once its runs have (conveyor.cli.warm_runner): third-party,
# slow to import (NumPy 0.1 CPU-s, pandas with pyarrow 0.4, dask.dataframe 0.5, distributed 0.5,
# scikit-learn 1.1, XGBoost 1.3, PyTorch 1.3 and 200 MB of the runner's memory: a stage that loads a
# model in conveyor's process, the reference's evaluate), read nothing of a run's directory as they
# load, and start no Python thread; their native threads (OpenBLAS's pool, pyarrow's jemalloc purger)
# are stopped or forgotten across a fork by their own atfork handlers. GNU OpenMP's pool (scikit-learn's,
# XGBoost's, torch's) does not survive a fork, but it is made by the first parallel region, which an
# import does not enter and the runner runs none of: it is made in the run (and torch starts CUDA only
# when a run asks for it). Not matplotlib (it reads a matplotlibrc in the working directory as it loads),
# nor a user's own packages. In the order they are imported.
LEARNABLE = ("numpy", "pandas", "pyarrow", "pyarrow.parquet", "dask", "dask.dataframe", "distributed", "scipy",
             "sklearn", "xgboost", "torch")
# The runner's pipe for a child's report of what it imported of LEARNABLE (set in the runner)
REPORT: list[int] = []


def record_imported() -> None:
    """In the runner, after its imports: what :func:`_conveyor_unchanged` compares with."""
    IMPORTED.clear()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "conveyor" or name.startswith("conveyor.")) and path:
            IMPORTED[path] = _signature(path)


def _signature(path: str) -> tuple[int, int, int, int] | None:
    """What changes when a file is written, replaced or touched: mtime, ctime, size, inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino


def _conveyor_unchanged() -> bool:
    """Whether every file conveyor's imported modules were read from is as it was (83 stats, 2 ms)."""
    return bool(IMPORTED) and all(_signature(path) == then for path, then in IMPORTED.items())


def _doubtful_bytecode_dropped() -> list[Path]:
    """Python's bytecode of the conveyor files changed since the runner read them, where it may be of
    the version before (an edit in the second the runner compiled it: :mod:`conveyor.spec.bytecode`)."""
    from conveyor.spec.bytecode import drop_doubtful

    return drop_doubtful(Path(path) for path, then in IMPORTED.items() if _signature(path) != then)


def settings_sources(here: Path) -> tuple[object, bool]:
    """The profiles file's signature (:func:`_signature`), and whether ``here`` holds a file Prefect reads
    settings from (prefect.toml, .env, a pyproject.toml with a [tool.prefect] table)."""
    from conveyor.prefect.kept import prefect_home

    profiles = _signature(os.environ.get("PREFECT_PROFILES_PATH") or str(prefect_home() / "profiles.toml"))
    local = (here / "prefect.toml").exists() or (here / ".env").exists()
    if not local:
        with contextlib.suppress(OSError):
            local = "[tool.prefect" in (here / "pyproject.toml").read_text(encoding="utf-8", errors="replace")
    return profiles, local


def child(runner: int, client: int, conn: socket.socket, fds: list[int], request: dict[str, Any],
          shared: list[Any]) -> None:
    """The forked child: become the client's process as a fresh one would be, run the command, exit."""
    code: int = 1
    try:
        _become(runner, fds, request, [conn, *shared])
        _anew_if_shadowed(request, client)
        atexit.register(_report_imported)  # run by every way the command exits (conveyor.cli.exits too)
        if sys.argv[1:2] == [TASK]:  # a deterministic stage's task (conveyor.cli.warm_task.task)
            from conveyor.run.isolated import main as run_task

            code = run_task([TASK, sys.argv[3]])  # TASK, LEAVE, PAYLOAD (conveyor.cli.warm_task.task)
        else:
            from conveyor.workspace import stand_in

            stand_in(client)  # the run lock and a kept server's lease name the command the user started
            from conveyor.cli.app import main

            main()
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  # as an uncaught exception ends a fresh process: its traceback, exit 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):  # as the interpreter's own exit: threads, then exit handlers
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _anew_if_shadowed(request: dict[str, Any], client: int) -> None:
    """Become a fresh ``conveyor`` (exec, in place: the same pid, descriptors and session) when a folder
    that the command may put first on ``sys.path`` holds a module named like a library this process
    has imported of :data:`LEARNABLE`: a fresh process would import the project's module, this one
    has the library (the runner learned it from another project's runs). Those folders: the working
    directory and those above it, and those above a path among the arguments (``-c FILE``); the
    project root, which a run puts first, is one of them. One listing per folder (1 ms)."""
    names = {name.partition(".")[0] for name in LEARNABLE if name in sys.modules}
    if not names:
        return
    here = Path.cwd()
    folders = dict.fromkeys([here, *here.parents])
    for arg in request["argv"][1:]:
        with contextlib.suppress(OSError, ValueError):
            given = (here / arg).resolve()
            if given.exists():
                folders.update(dict.fromkeys([given, *given.parents]))
    for folder in folders:
        for name in names:
            found = importlib.machinery.PathFinder.find_spec(name, [str(folder)])
            loaded = getattr(sys.modules[name], "__file__", None)
            if found is not None and found.origin and (
                    loaded is None or os.path.realpath(found.origin) != os.path.realpath(loaded)):
                command = [sys.executable, *request["orig_argv"][1:]]  # as the client was started
                os.execve(sys.executable, command, {**os.environ, ANEW: str(client)})  # noqa: S606


def origin(name: str) -> str | None:
    """The file ``import name`` would load in this process (not loaded; a submodule's package is imported)."""
    spec = importlib.util.find_spec(name)
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else None


def _report_imported() -> None:
    """Tell the runner which of :data:`LEARNABLE` this run imported, and from which file (one line of
    JSON, written whole: under PIPE_BUF), for it to import the same before the next run; never waits
    (a full pipe drops it). An exit handler: every way a command ends runs those (a kill does not:
    nothing is learned then)."""
    found = {name: path for name in LEARNABLE if (path := getattr(sys.modules.get(name), "__file__", None))}
    if found and REPORT:
        with contextlib.suppress(OSError):
            os.write(REPORT[0], (json.dumps(found) + "\n").encode())


def _become(runner: int, fds: list[int], request: dict[str, Any], inherited: list[Any]) -> None:
    os.setsid()  # out of the runner's group: its signals are its own
    _die_with(runner)
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for item in inherited:
        with contextlib.suppress(OSError):
            if isinstance(item, socket.socket):
                item.close()
            else:
                os.close(item)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    STARTED_WITH.clear()
    STARTED_WITH.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[:] = list(request["path"])
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())  # as a fresh process's stdout would be
    if not _conveyor_unchanged():
        _doubtful_bytecode_dropped()
        for name in [m for m in sys.modules if m == "conveyor" or m.startswith("conveyor.")]:
            del sys.modules[name]  # conveyor's code as it is on disk now, this module's included
    _libraries_here()


def _libraries_here() -> None:
    """What the libraries set up as they were imported, set up again for this process: DVC's log
    handlers and colorama's wrapping of stdout (``import dvc`` wraps a stream that is not a terminal
    to strip colours: the runner's was /dev/null), Prefect's settings as this directory and
    environment give them (a ``prefect.toml``, a ``.env`` here), its console handler's colours,
    and conveyor's consoles where its modules were kept."""
    if "colorama" in sys.modules:
        sys.modules["colorama"].deinit()  # sys.stdout and sys.stderr unwrapped
    if "dvc.logger" in sys.modules:
        dvc_logger = sys.modules["dvc.logger"]
        for name in ("dvc", "dvc_objects", "dvc_data"):
            named = logging.getLogger(name)
            for handler in [h for h in named.handlers if isinstance(h, dvc_logger.LoggerHandler)]:
                named.removeHandler(handler)
        dvc_logger.setup()  # as `import dvc` does, with this process's streams
    if "conveyor.cli.common" in sys.modules:
        sys.modules["conveyor.cli.common"].consoles_here()
    if "dask.config" in sys.modules:  # imported in the runner (LEARNABLE): Dask's YAML files and DASK_* as now
        sys.modules["dask.config"].refresh()
    if "numpy.random" in sys.modules:  # its global RandomState, seeded at import: from fresh entropy again, or
        sys.modules["numpy.random"].seed()  # every run would draw the runner's numbers (`random` reseeds itself)
    if "prefect.context" in sys.modules:
        from conveyor.prefect.server import bounded_environ

        # what every run sets first (the runner had them set as it imported Prefect): in place before
        # the runner's settings are compared with this run's, so that the run's bound_client() finds them
        bounded_environ()
        from prefect.logging.handlers import PrefectConsoleHandler

        now = settings_sources(Path.cwd())
        if not SETTINGS_READ or now[1] or SETTINGS_READ[0] != now:  # else the runner's are this run's own
            sys.modules["prefect.context"].refresh_global_settings_context()
        for logger in [logging.getLogger(), *[logging.getLogger(name) for name in logging.root.manager.loggerDict]]:
            for handler in logger.handlers:
                if not isinstance(handler, PrefectConsoleHandler):
                    continue
                wrapped = getattr(handler.stream, "wrapped", None)  # created on colorama's wrapper of stderr
                if wrapped is not None:
                    handler.setStream(wrapped)
                    handler.console.file = wrapped
                if hasattr(handler.console, "_detect_color_system"):  # rich decides colours once, at creation
                    handler.console._color_system = handler.console._detect_color_system()


def _die_with(runner: int) -> None:
    """SIGKILL when the runner dies (PR_SET_PDEATHSIG): a child never outlives it unwatched."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != runner:  # it died before the signal was set
        os._exit(1)
