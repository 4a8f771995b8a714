"""Stage logs: ``.conveyor/logs/<run_id>/<stage>.log``, one file per stage and run.

What a stage writes lands there: a ``cmd`` stage's stdout and stderr line by line; a task's
``ctx.log`` records and its prints (Prefect turns those into records of its task-run
logger); and, during ``conveyor run``, whatever its thread writes to stdout or stderr,
libraries' log lines included (:mod:`conveyor.run.capture`). Attempts of a retried stage
append to the same file, each headed by a line saying which attempt it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextvars import Token
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO

from conveyor.errors import UsageError, redact
from conveyor.run.capture import LineSink, current_sink
from conveyor.workspace import STATE_DIR, state_dir

# Stage loggers are children of Prefect's task-run logger: in a flow their records (and a
# task's prints) reach Prefect's API, and one handler there sees them all.
TASK_LOGGER = "prefect.task_runs"
# logs of a run that are no stage's: Prefect, Dask and the rest (run.log), a temporary server's
RUN_LOGS = frozenset({"run", "prefect-server"})


class Redacting(logging.Filter):
    """Credentials in URLs out of every record (Prefect sends a task's records to its API)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = redact(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


_REDACTING = Redacting()


def stage_logger(stage: str) -> logging.Logger:
    """``ctx.log`` of ``stage``: logs at INFO and up even where nothing configured logging."""
    logger = logging.getLogger(f"{TASK_LOGGER}.{stage}")
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    if _REDACTING not in logger.filters:
        logger.addFilter(_REDACTING)
    return logger


def logs_dir(root: Path, run_id: str) -> Path:
    """``.conveyor/logs/<run_id>/``: the run's stage logs and its run.log."""
    return state_dir(root) / "logs" / run_id


def log_path(root: Path, run_id: str, stage: str) -> Path:
    return logs_dir(root, run_id) / f"{stage}.log"


def find_log(root: Path, stage: str, run_id: str | None = None) -> tuple[Path, str]:
    """The log of ``stage`` in run ``run_id``, or in the last run that ran it; UsageError if none.
    Only reads: no .conveyor/ is made (a read-only checkout may have none)."""
    folder = root / STATE_DIR / "logs"
    if run_id is not None:
        path = folder / run_id / f"{stage}.log"
        if path.is_file():
            return path, run_id
        known = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if run_id not in known:
            raise UsageError(f"no run '{run_id}' in {folder} (runs: {', '.join(known[-5:]) or 'none yet'})")
        ran = _staged(folder / run_id)
        raise UsageError(f"stage '{stage}' did not run in run {run_id} (it ran: {', '.join(ran) or 'nothing'})")
    runs = sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True) if folder.is_dir() else []
    for run in runs:  # run ids start with their UTC time: newest first
        path = run / f"{stage}.log"
        if path.is_file():
            return path, run.name
    staged = sorted({stage for run in runs for stage in _staged(run)})
    from conveyor.errors import did_you_mean

    hint = did_you_mean(stage, staged)
    raise UsageError(f"no log of stage '{stage}' in {folder}{hint}: it has not run yet "
                     f"(stages with logs: {', '.join(staged) or 'none'})")


def _staged(run: Path) -> list[str]:
    """The stages with a log in a run's folder; a stage of another dvc.yaml (``sub/dvc.yaml:make``)
    has its log in a folder below (``sub/dvc.yaml:make.log``)."""
    found = (p.relative_to(run).as_posix().removesuffix(".log") for p in run.rglob("*.log"))
    return sorted(stage for stage in found if stage not in RUN_LOGS)


class _StageFormatter(logging.Formatter):
    """``12:00:01 INFO    message`` for the stage's own logger, ``[name]`` for others; prints as printed."""

    def __init__(self, own: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")
        self.own = own
        self.named = logging.Formatter("%(asctime)s %(levelname)-7s [%(name)s] %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == TASK_LOGGER and _PREFECT not in Path(record.pathname).parents:
            return record.getMessage()  # a print turned into a record by Prefect's log_prints
        return super().format(record) if record.name == self.own else self.named.format(record)


def _prefect_package() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    return Path(spec.origin).parent if spec is not None and spec.origin else Path("/nonexistent")


_PREFECT = _prefect_package()


class _StageHandler(logging.Handler):
    """Writes the task-run records emitted while its stage runs in this context."""

    def __init__(self, owner: StageLog) -> None:
        super().__init__()
        self.owner = owner
        self.setFormatter(_StageFormatter(owner.logger_name))

    def emit(self, record: logging.LogRecord) -> None:
        # the stage's own logger from any thread (a task's thread pool too); from its context, the
        # other task-run records (prints, Prefect's) but not those of another stage's logger
        own = record.name == self.owner.logger_name
        other_stage = not own and record.name.startswith(f"{TASK_LOGGER}.")
        if own or (not other_stage and current_sink.get() is self.owner.sink):
            self.owner.line("log", self.format(record), note=record.getMessage())


class StageLog:
    """The log file of one stage attempt; where the stage's records and output go while open."""

    def __init__(self, path: Path, stage: str, attempt: int = 1,
                 on_line: Callable[[str], None] | None = None) -> None:
        self.path, self.attempt, self.on_line = path, attempt, on_line
        self.logger_name = f"{TASK_LOGGER}.{stage}"
        self.sink: LineSink = self.line  # one bound method, so the handler can compare by identity
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._handler = _StageHandler(self)
        self._token: Token[LineSink | None] | None = None

    def __enter__(self) -> StageLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._file.write(f"--- attempt {self.attempt}, {datetime.now(UTC).isoformat(timespec='seconds')}\n")
        self._token = current_sink.set(self.sink)
        logging.getLogger(TASK_LOGGER).addHandler(self._handler)
        return self

    def line(self, stream: str, text: str, note: str | None = None) -> None:
        """One line from ``stream`` (``out``, ``err`` or ``log``): into the file, and to ``on_line``
        (``note``, if given, is what to show there: a record's message without its time)."""
        text = redact(text)
        with self._lock:
            if self._file is not None:
                self._file.write(text + "\n")  # stdout and stderr interleaved, as on a terminal
        shown = redact(note).strip() if note is not None else text.strip()
        if self.on_line is not None and shown:
            self.on_line(shown.splitlines()[0])

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        logging.getLogger(TASK_LOGGER).removeHandler(self._handler)
        if self._token is not None:
            current_sink.reset(self._token)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
