"""The live view of a run: a line per stage (state, time, profile, progress), redrawn in a terminal,
printed line by line elsewhere. The scheduling loop tells it what happens (any thread)."""

from __future__ import annotations

import threading
import time
from types import TracebackType

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from conveyor.run import capture
from conveyor.run.context import StageProgress
from conveyor.run.schedule import Outcome

STYLE = {"waiting": "dim", "running": "cyan", "succeeded": "green", "skipped": "blue",
         "failed": "bold red", "not_run": "yellow", "interrupted": "bold yellow"}
ICON = {"waiting": "·", "running": "▶", "succeeded": "✔", "skipped": "↷", "failed": "✘",
        "not_run": "-", "interrupted": "■"}


class RunView:
    """Receives stage events from the runner (any thread) and shows them."""

    def __init__(self, stages: list[str], console: Console | None = None) -> None:
        self.console = console or capture.console()
        self.state: dict[str, str] = dict.fromkeys(stages, "waiting")
        self.note: dict[str, str] = dict.fromkeys(stages, "")
        self.profile: dict[str, str] = dict.fromkeys(stages, "")
        self.began: dict[str, float] = {}
        self.took: dict[str, float] = {}
        self.progress: dict[str, StageProgress] = {}
        self._lock = threading.Lock()
        self._live: Live | None = None

    def __enter__(self) -> RunView:
        if self.console.is_terminal:
            # under a capture, prints belong in the logs, not above the table
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False,
                              redirect_stdout=not capture.active(), redirect_stderr=not capture.active())
            self._live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)

    def started(self, stage: str, profile: str, progress: StageProgress) -> None:
        with self._lock:
            self.state[stage], self.profile[stage] = "running", profile
            self.began.setdefault(stage, time.monotonic())
            self.progress[stage] = progress
        self._plain(stage, f"running on {profile}")

    def retrying(self, stage: str, attempt: int, error: str) -> None:
        self._plain(stage, f"attempt {attempt} failed ({error}); retrying")

    def warning(self, stage: str, line: str) -> None:
        """What the user must know of a stage that is not its outcome: one line, live view or not."""
        self.console.print(Text.assemble(("WARNING ", "bold yellow"), line), soft_wrap=True)  # no markup: paths

    def notice(self, stage: str, line: str) -> None:
        """What the user should know of a stage as it starts (it resumes a checkpoint): one line."""
        self.console.print(Text(line), soft_wrap=True)

    def finished(self, stage: str, outcome: Outcome, seconds: float, note: str = "") -> None:
        with self._lock:
            self.state[stage], self.note[stage], self.took[stage] = outcome.value, note, seconds
        self._plain(stage, f"{outcome.value} in {seconds:.1f}s" + (f" ({note})" if note else ""))

    def interrupted(self, stage: str, seconds: float) -> None:
        """Ctrl-C or SIGTERM stopped ``stage`` (or it was abandoned, blocked in a C call)."""
        with self._lock:
            self.state[stage], self.note[stage], self.took[stage] = "interrupted", "", seconds
        self._plain(stage, f"interrupted after {seconds:.1f}s")

    def _plain(self, stage: str, text: str) -> None:
        if self._live is None:
            self.console.print(f"[{STYLE.get(self.state[stage], '')}]{stage}[/]: {text}", highlight=False)

    def __rich__(self) -> RenderableType:
        table = Table.grid(padding=(0, 2))
        now = time.monotonic()
        with self._lock:
            for stage, state in self.state.items():
                secs = self.took.get(stage, now - self.began[stage] if stage in self.began else 0.0)
                detail = self.progress[stage].render() if state == "running" and stage in self.progress \
                    else self.note[stage]
                table.add_row(Text(f"{ICON[state]} {stage}", style=STYLE[state]), Text(state),
                              Text(f"{secs:6.1f}s" if stage in self.began else ""),
                              Text(self.profile[stage], style="dim"),
                              Text(detail, style="dim", no_wrap=True, overflow="ellipsis"))
        return table
