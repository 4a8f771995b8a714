"""Stage logs: ``.conveyor/logs/<run_id>/<stage>.log``, one file per stage and run.

A ``cmd`` stage's stdout and stderr go there line by line; a task's ``ctx.log`` records
too (they also reach Prefect, through its own handlers). Attempts of a retried stage
append to the same file, each headed by a line saying which attempt it is.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO

from conveyor.workspace import state_dir

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_path(root: Path, run_id: str, stage: str) -> Path:
    return state_dir(root) / "logs" / run_id / f"{stage}.log"


class StageLog:
    """The log file of one stage attempt; also the handler of its task's logger while open."""

    def __init__(self, path: Path, logger: logging.Logger | None = None, attempt: int = 1) -> None:
        self.path, self.logger, self.attempt = path, logger, attempt
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._handler: logging.Handler | None = None

    def __enter__(self) -> StageLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._file.write(f"--- attempt {self.attempt}, {datetime.now(UTC).isoformat(timespec='seconds')}\n")
        if self.logger is not None:
            self._handler = logging.StreamHandler(self._file)
            self._handler.setFormatter(logging.Formatter(FORMAT))
            self.logger.addHandler(self._handler)
            if self.logger.getEffectiveLevel() > logging.INFO:
                self.logger.setLevel(logging.INFO)
        return self

    def line(self, stream: str, text: str) -> None:
        """One line a command wrote to ``stream`` (``out`` or ``err``)."""
        with self._lock:
            if self._file is not None:
                self._file.write(text + "\n")  # stdout and stderr interleaved, as on a terminal

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.logger is not None and self._handler is not None:
            self.logger.removeHandler(self._handler)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
