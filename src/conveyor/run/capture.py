"""Where output goes during ``conveyor run``: the stage logs, not the terminal.

The terminal belongs to the live view. While a run executes, everything else the process
and its children write lands in log files under ``.conveyor/logs/<run_id>/``:

* a line written from a stage's own thread (its prints, the log records of libraries it
  calls: DVC, the Dask client, ...) goes to that stage's log (:mod:`conveyor.run.logs`
  marks the thread's context while the stage runs);
* anything else (library threads such as XGBoost's tracker, Dask worker processes,
  C libraries writing to file descriptors 1 and 2, Prefect's embedded server) goes to
  ``run.log`` beside them.

``-v`` also echoes every captured line above the live view. Python-level writes are
routed through ``sys.stdout``/``sys.stderr`` and the streams of existing logging handlers;
writes below Python reach the process's descriptors 1 and 2, which point into a pipe read
by a thread for as long as the run lasts.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import select
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO, TextIO, cast

from rich.console import Console

from conveyor.errors import redact

LineSink = Callable[[str, str], None]  # (stream "out" | "err", line without newline)

# The stage log of the running context, set by StageLog while a stage runs in this thread.
current_sink: ContextVar[LineSink | None] = ContextVar("conveyor_stage_sink", default=None)

_console: Console | None = None
_verbose: list[LineSink] = []  # the terminal's echo while a verbose capture is active


def active() -> bool:
    """Whether a capture owns the terminal now."""
    return _console is not None


def console() -> Console:
    """Where the live view draws: the real terminal while a capture is active, else stderr."""
    return _console if _console is not None else Console(stderr=True)


def verbose_echo() -> LineSink | None:
    """Where a stage's own lines also go in a verbose capture (``conveyor run -v``): the terminal,
    as a task's prints do; None otherwise (they go to the stage's log and the live view only)."""
    return _verbose[0] if _verbose else None


class _RouterStream(io.TextIOBase):
    """A text stream that hands complete lines to the running stage's log, or to ``fallback``."""

    encoding = "utf-8"  # some libraries read it before writing (TextIOBase says None)

    def __init__(self, name: str, fallback: LineSink, echo: LineSink | None, fd: int | None) -> None:
        self.name, self._fallback, self._echo, self._fd = name, fallback, echo, fd
        self._partial: dict[int, str] = {}  # per thread: text after the last newline
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False  # libraries must not draw progress bars into a log

    def fileno(self) -> int:
        """The process's own descriptor (it leads into run.log while the capture lasts): what code
        handing stderr to a child process or to faulthandler needs (multiprocessing does)."""
        if self._fd is None:
            raise io.UnsupportedOperation("fileno")
        return self._fd

    def write(self, text: str) -> int:
        ident = threading.get_ident()
        with self._lock:
            buffered = self._partial.pop(ident, "") + text
            *lines, rest = buffered.split("\n")
            if rest:
                self._partial[ident] = rest
        stage = current_sink.get()
        for line in lines:
            line = line.rstrip("\r")
            if stage is None:
                self._fallback(self.name, line)  # run.log, echoed there when verbose
                continue
            stage(self.name, line)
            if self._echo is not None:
                self._echo(self.name, line)
        return len(text)

    def flush(self) -> None:
        """Nothing to do: lines are handed on whole (``print(".", end="", flush=True)`` waits for its line)."""

    def finish(self) -> None:
        """Hand on what is left of unfinished lines (at the end of the capture)."""
        with self._lock:
            partial, self._partial = self._partial, {}
        for rest in partial.values():
            if rest.strip():
                self._fallback(self.name, rest)


class _StageRecords(logging.Filter):
    """On Prefect's console handler: a record logged from a stage's context goes to the stage's log.

    Task-run records (``ctx.log``, prints) are already there (the stage log's own handler):
    they are only kept off the terminal. Others (a library the stage called) are written.
    """

    def __init__(self, echo: LineSink | None) -> None:
        super().__init__()
        self.echo = echo
        self.formatter = logging.Formatter("%(asctime)s %(levelname)-7s [%(name)s] %(message)s", datefmt="%H:%M:%S")

    def filter(self, record: logging.LogRecord) -> bool:
        sink = current_sink.get()
        if sink is None:
            return True
        text = self.formatter.format(record)
        if not record.name.startswith("prefect.task_runs"):
            sink("log", text)
        if self.echo is not None:
            self.echo("err", text)
        return False


class RunLog:
    """``run.log``: what no stage claims; echoed to the terminal too when ``echo`` is given."""

    def __init__(self, path: Path, echo: LineSink | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.echo = path, echo
        self._file: IO[str] = path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def __call__(self, stream: str, line: str) -> None:
        line = redact(line)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        if self.echo is not None:
            self.echo(stream, line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


@contextlib.contextmanager
def capture_output(run_log: Path, verbose: bool = False) -> Iterator[Console]:
    """Send all output of this process and its children to the logs; yields the terminal's console.

    ``verbose``: also print every captured line on the terminal, above the live view.
    Restores everything on exit, also on an exception.
    """
    global _console
    log = RunLog(run_log, _echo if verbose else None)
    if verbose:
        _verbose.append(_echo)
    saved: dict[int, int] = {}
    terminal: TextIO | None = None
    reader: threading.Thread | None = None
    stop = threading.Event()
    swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
    prefect_handlers: list[logging.Handler] = []
    stage_records = _StageRecords(log.echo)
    old_out, old_err = sys.stdout, sys.stderr
    try:
        for fd in (1, 2):
            try:
                saved[fd] = os.dup(fd)
            except OSError:
                continue
        terminal = open(os.dup(saved[2]), "w", encoding="utf-8", errors="replace",  # noqa: SIM115
                        buffering=1) if 2 in saved else old_err
        _console = Console(file=terminal)
        if saved:
            read_end, write_end = os.pipe()
            for fd in saved:
                os.dup2(write_end, fd)
            os.close(write_end)
            reader = threading.Thread(target=_drain, args=(read_end, log, stop), name="conveyor-capture", daemon=True)
            reader.start()
        sys.stdout = cast(TextIO, _RouterStream("out", log, log.echo, 1 if 1 in saved else None))
        sys.stderr = cast(TextIO, _RouterStream("err", log, log.echo, 2 if 2 in saved else None))
        swapped = _swap_handler_streams({id(old_out): sys.stdout, id(old_err): sys.stderr,
                                         id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr})
        prefect_handlers = [h for lg in _loggers() for h in lg.handlers if type(h).__module__.startswith("prefect")
                            and isinstance(h, logging.StreamHandler)]
        for handler in prefect_handlers:
            handler.addFilter(stage_records)
        yield _console
    finally:
        if verbose:
            _verbose.remove(_echo)
        for router in (sys.stdout, sys.stderr):
            if isinstance(router, _RouterStream):
                router.finish()
        for handler, original in swapped:
            handler.setStream(original)
        for prefect_handler in prefect_handlers:
            prefect_handler.removeFilter(stage_records)
        sys.stdout, sys.stderr = old_out, old_err
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        stop.set()  # the reader takes what is in the pipe, then closes it
        if reader is not None:
            reader.join(timeout=5.0)
        if terminal is not None and terminal is not old_err:
            terminal.close()
        _console = None
        log.close()


def _echo(stream: str, line: str) -> None:
    if _console is not None:
        _console.print(line, markup=False, highlight=False, style="dim" if stream == "err" else None)


def _drain(fd: int, log: RunLog, stop: threading.Event) -> None:
    """Read the pipe into ``log`` until ``stop`` is set and nothing more is waiting in it.

    Not until EOF: a process started during the run and outliving it (Python's multiprocessing
    resource tracker does, by design) holds the pipe open. Once the reader is gone it closes
    its end, so such a process gets EPIPE instead of blocking on a full pipe.
    """
    pending = b""
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                if stop.is_set():
                    break
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                log("err", line.decode("utf-8", "replace").rstrip("\r"))
        if pending:
            log("err", pending.decode("utf-8", "replace"))
    finally:
        os.close(fd)


def _swap_handler_streams(replace: dict[int, TextIO]) -> list[tuple[logging.StreamHandler[TextIO], TextIO]]:
    """Point every logging handler that writes to the terminal streams at the routers instead."""
    swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
    for logger in _loggers():
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in replace \
                    and not type(handler).__module__.startswith("prefect"):  # Prefect's: by its own settings
                old = handler.setStream(replace[id(handler.stream)])
                if old is not None:
                    swapped.append((handler, old))
    return swapped


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                   if isinstance(lg, logging.Logger))]
