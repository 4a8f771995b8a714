"""A task in a process of its own, started with the deterministic environment.

The settings that decide a numeric library's kernels are read when it loads
(:mod:`conveyor.run.determinism`), and conveyor's own process has loaded NumPy and its
OpenBLAS long before a stage starts: a task that asks for ``deterministic: true`` cannot
get them in that process. So it runs in a child, ``python -m conveyor.run.isolated PAYLOAD``,
started as a ``cmd`` stage is (:mod:`conveyor.run.commands`: its own process group, killed
with the run, on Ctrl-C, at its timeout, or when conveyor dies), with the pinned environment;
or, where the command line says so (:data:`STARTERS`), a process of the same kind that hands the
task to a warm runner of that environment, which forks it with the task's libraries imported
under the pins (:mod:`conveyor.cli.warm_task`).

The parent writes what the task's :class:`StageContext` holds to ``PAYLOAD`` (pickled: params
keep their YAML types); the child imports the task, calls it, and speaks back on its
stdout and stderr: its prints and log records become lines of the stage's log, its
progress travels as lines the parent reads into the live view, and on failure the
exception's one-line summary is written beside the payload, for the parent to raise.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shlex
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import StageError
from conveyor.run.checkpoints import ENV_DIR
from conveyor.run.context import MatrixItem, StageContext, StageProgress
from conveyor.workspace import alive, state_dir

if TYPE_CHECKING:
    from conveyor.run.commands import Sink

PROGRESS = "\x1econveyor-progress "  # a line of the child's stdout that is progress, not output
# How a task's process starts where the command line has said (conveyor.cli.warm_task.task_start: handed
# to a warm runner of the pinned environment, which forks it): ``the stage's variables -> argv``, the
# payload's path appended; none: a fresh interpreter, ``python -m conveyor.run.isolated PAYLOAD``
STARTERS: list[Callable[[Mapping[str, str]], list[str]]] = []
_EVERY_S = 0.1  # at most this often a progress line


@dataclass(frozen=True)
class Payload:
    """What the child needs to build the task's StageContext (a picklable part of it)."""

    task: str  # module:function
    stage: str
    root: str
    params: Mapping[str, Any]
    deps: Mapping[str, str]
    outs: Mapping[str, str]
    metrics: Mapping[str, str]
    names: Mapping[str, str] = field(default_factory=dict)
    item: Any = None
    needed: Mapping[str, Mapping[str, MatrixItem]] = field(default_factory=dict)  # ctx.items(): plain data, pickles
    threads: int = 0  # a threads profile's max_workers: the child's own executor; 0 for none

    def write(self, path: Path) -> None:
        path.write_bytes(pickle.dumps(self))


def run_isolated(payload: Payload, *, env: Mapping[str, str], timeout_s: float | None, progress: StageProgress,
                 sink: Sink) -> None:
    """The parent's side: the task of ``payload`` in a child started with ``env`` over the runner's
    environment, as a command runs (its own process group, ended on Ctrl-C, at ``timeout_s``,
    and when this process dies); its lines go to ``sink``, its progress to ``progress``. Raises
    the task's error as a :class:`StageError`, or :class:`CommandFailed` when the child was
    killed before it could say."""
    from conveyor.run.commands import Command, CommandFailed, run_here  # the parent's: the child stays lean

    root, stage = Path(payload.root), payload.stage
    state = state_dir(root)
    _remove_left_by_dead(state)
    with tempfile.TemporaryDirectory(prefix=f"isolated-{os.getpid()}-", dir=state) as tmp:
        path = Path(tmp) / "payload.pickle"
        payload.write(path)
        command = Command(stage, (command_line(path, env),), cwd=str(root), env=env, timeout_s=timeout_s)
        finished = run_here(command, relay(progress, sink))
        if finished.returncode != 0:
            summary = error_path(path).read_text(encoding="utf-8") if error_path(path).exists() else ""
            if not summary:
                raise CommandFailed(stage, finished.returncode, finished.stderr_tail)
            raise StageError(stage, summary)


def _remove_left_by_dead(state: Path) -> None:
    """The payload folders of runners killed mid-stage (kill -9 skips the ``with`` that removes
    them): the pid in the name says whose each was."""
    for left in state.glob("isolated-*-*"):
        pid = left.name.split("-")[1]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)


def command_line(payload: Path, env: Mapping[str, str]) -> str:
    """The shell command that runs the task of ``payload`` with ``env`` over the runner's environment: in a
    fresh interpreter (this one's), or as the command line's starter says (:data:`STARTERS`)."""
    if STARTERS:
        return shlex.join([*STARTERS[0](env), str(payload)])
    return shlex.join([sys.executable, "-m", "conveyor.run.isolated", str(payload)])


def error_path(payload: Path) -> Path:
    """Where the child writes its exception's one-line summary."""
    return payload.with_suffix(".error")


def relay(progress: StageProgress, log: Sink) -> Sink:
    """A command sink for the child's lines: progress lines into ``progress``, the rest to ``log``."""

    def sink(stream: str, line: str) -> None:
        if stream == "out" and line.startswith(PROGRESS):
            state = json.loads(line[len(PROGRESS):])
            progress.start(state["total"], unit=state["unit"], description=state["description"])
            progress.advance(state["completed"])
        else:
            log(stream, line)

    return sink


class _RelayedProgress(StageProgress):
    """The child's ``ctx.progress``: every change also goes to stdout as one line, at most every 0.1 s."""

    def __init__(self) -> None:
        super().__init__()
        self._sent = 0.0
        self._write_lock = threading.Lock()

    def start(self, total: float | None, *, unit: str = "", description: str = "") -> None:
        super().start(total, unit=unit, description=description)
        self.send(force=True)

    def advance(self, amount: float = 1.0) -> None:
        super().advance(amount)
        self.send()

    def send(self, *, force: bool = False) -> None:
        now = time.monotonic()
        with self._write_lock:
            if not force and now - self._sent < _EVERY_S:
                return
            self._sent = now
            state = {"total": self.total, "completed": self.completed, "unit": self.unit,
                     "description": self.description}
            sys.stdout.write(PROGRESS + json.dumps(state) + "\n")
            sys.stdout.flush()


def _context(payload: Payload, executor: ThreadPoolExecutor | None, progress: StageProgress) -> StageContext:
    from conveyor.run.logs import stage_logger

    logger = stage_logger(payload.stage)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return StageContext(
        stage=payload.stage, params=payload.params, root=Path(payload.root), log=logger,
        deps={k: Path(v) for k, v in payload.deps.items()}, outs={k: Path(v) for k, v in payload.outs.items()},
        metrics={k: Path(v) for k, v in payload.metrics.items()}, names=payload.names, item=payload.item,
        needed=payload.needed,
        executor=executor, n_workers=payload.threads or 1, progress=progress,
        checkpoint_dir=Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else None,
    )


def main(argv: list[str]) -> int:
    """The child: run the task of the payload at ``argv[1]``; 0 when it returned, 1 when it raised."""
    import importlib

    path = Path(argv[1])
    payload: Payload = pickle.loads(path.read_bytes())  # noqa: S301  # written by the parent, for this child
    progress = _RelayedProgress()
    try:
        if payload.root not in sys.path:  # the project's packages first, as in the runner (spec.project's
            sys.path.insert(0, payload.root)  # ensure_importable, whose module costs 0.1 s of pydantic to import)
        module, _, function = payload.task.partition(":")
        fn = getattr(importlib.import_module(module), function)
        with ThreadPoolExecutor(payload.threads) if payload.threads else nullcontext() as executor:
            fn(_context(payload, executor, progress))
    except Exception as exc:  # noqa: BLE001  # whatever the task raised: its summary for the parent, the traceback to the log
        traceback.print_exc(file=sys.stderr)
        text = str(exc).strip().splitlines()
        summary = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        error_path(path).write_text(summary, encoding="utf-8")
        return 1
    finally:
        progress.send(force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
