"""Running one stage: the skip check, its StageContext, atomic outs, the record update.

Prefect-free, so ``conveyor exec`` (what ``dvc repro`` calls) and the Prefect flow share it.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

from conveyor.errors import StageError
from conveyor.plan.dag import Outcome
from conveyor.plan.fingerprint import Record
from conveyor.run.context import StageContext, StageProgress
from conveyor.run.outs import staged_outs
from conveyor.run.profiles import Profiles, Resources
from conveyor.run.record import RunRecord, now
from conveyor.spec.project import Project, ensure_importable


class StageEvents(Protocol):
    """Who hears about a stage starting and retrying (the live view)."""

    def started(self, stage: str, profile: str, progress: StageProgress) -> None: ...

    def retrying(self, stage: str, attempt: int, error: str) -> None: ...


def load_task(project: Project, stage: str) -> Callable[[StageContext], None]:
    """Import the stage's task function (only when the stage really runs)."""
    spec = project.pipeline.stages[stage]
    ensure_importable(project.root)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    if not callable(fn):
        raise StageError(stage, f"{spec.task} is not callable")
    return fn  # type: ignore[no-any-return]


class StageRunner:
    """Runs one attempt of one stage: skip check, context, atomic outs, record update."""

    def __init__(self, project: Project, profiles: Profiles, force: bool, run: RunRecord,
                 view: StageEvents, record: Record | None) -> None:
        """``record`` None: run without recording (``dvc repro`` records the stage itself)."""
        self.project, self.profiles, self.force, self.run, self.view = project, profiles, force, run, view
        self.record = record
        self._mutex = threading.Lock()
        self._threads: dict[str, int] = {}

    def __call__(self, stage: str) -> Outcome:
        spec = self.project.pipeline.stages[stage]
        record = self.run.stages[stage]
        with self._mutex:
            record.attempts += 1
            record.started = record.started or now().isoformat()
        record.profile = self.profiles.resolve(spec.on) or "local"
        if record.attempts == 1:
            reasons = self._reasons(stage)
            if not reasons:
                record.reason = "up to date"
                return Outcome.SKIPPED
            record.reason = "; ".join(reasons)
        resources = self.profiles.get(spec.on)
        progress = StageProgress()
        self.view.started(stage, record.profile, progress)
        self._threads[stage] = threading.get_ident()
        try:
            self._attempt(stage, resources, progress)
        except BaseException as exc:
            record.trace = user_frames(exc, self.project.root)
            if record.attempts <= spec.retries:
                self.view.retrying(stage, record.attempts, short_error(exc))
            raise
        finally:
            self._threads.pop(stage, None)
        return Outcome.SUCCEEDED

    def interrupt(self) -> list[str]:
        """Raise KeyboardInterrupt inside every running stage (Ctrl-C); returns their names.

        The exception lands at the stage's next Python instruction, as Prefect's own task
        timeouts do; a stage blocked inside a C call stops when that call returns.
        """
        stopped = []
        for stage, ident in list(self._threads.items()):
            if ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                          ctypes.py_object(KeyboardInterrupt)) == 1:
                stopped.append(stage)
        return stopped

    def _reasons(self, stage: str) -> list[str]:
        if self.force or self.record is None:
            return ["forced"]
        return self.record.reasons(stage)

    def _attempt(self, stage: str, resources: Resources, progress: StageProgress) -> None:
        project, spec = self.project, self.project.pipeline.stages[stage]
        fn = load_task(project, stage)
        with staged_outs(project.root, stage, list(spec.written)) as staging:
            ctx = StageContext(
                stage=stage, params=project.stage_params(stage),
                deps={d: project.root / d for d in spec.deps},
                outs={o: staging[o] for o in spec.outs}, metrics={m: staging[m] for m in spec.metrics},
                root=project.root, log=logging.getLogger(f"prefect.task_runs.{stage}"),
                client=resources.client, executor=resources.executor, n_workers=resources.n_workers,
                devices=resources.devices, progress=progress,
            )
            with current_client(resources.client) if resources.client is not None else nullcontext():
                fn(ctx)
        if self.record is not None:
            self.record.save(stage)


@contextmanager
def current_client(client: Any) -> Iterator[None]:
    """Make ``client`` the one dask computes on, in this stage's thread only.

    ``Client.as_current()`` would also set dask's process-wide ``scheduler`` config and
    restore it on exit; stages running at once exit in any order and would leave it
    wrong for the rest of the process. The context-local client alone is enough:
    with no ``scheduler`` configured, dask asks ``distributed.get_client()``, which returns it.
    """
    from distributed.client import _current_client  # the contextvar behind Client.current()

    token = _current_client.set(client)
    try:
        yield
    finally:
        _current_client.reset(token)


def user_frames(exc: BaseException, root: Path) -> str:
    """The traceback lines that point into the project's own code (its tasks), not libraries."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(root)]
    return "".join(traceback.format_list(frames)).rstrip()


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _QuietEvents:
    """Events of a single ``conveyor exec``: one log line each."""

    def started(self, stage: str, profile: str, progress: StageProgress) -> None:
        logging.getLogger("conveyor").info("%s: running on %s", stage, profile)

    def retrying(self, stage: str, attempt: int, error: str) -> None:
        logging.getLogger("conveyor").warning("%s: attempt %d failed: %s", stage, attempt, error)


def run_one(project: Project, stage: str) -> None:
    """Run exactly one stage now, in this process, with its profile (``conveyor exec``).

    Always runs. Under DVC (the spec dvc.yaml is compiled from) DVC decided it is due and
    records it itself; for any other spec conveyor's own record is updated.
    """
    from conveyor.dvc.compile import compiled_from
    from conveyor.plan.fingerprint import FingerprintRecord
    from conveyor.run.record import RunRecord, StageRecord

    run = RunRecord(run_id="exec", pipeline=project.pipeline.pipeline, stages={stage: StageRecord()})
    record = None if compiled_from(project) else FingerprintRecord(project)
    with Profiles(project.pipeline.profiles) as profiles:
        for warning in profiles.check({project.pipeline.stages[stage].on}):
            logging.getLogger("conveyor").warning("WARNING %s", warning)
        StageRunner(project, profiles, True, run, _QuietEvents(), record)(stage)
