"""The run record of SPEC.md section 5: what ran, how long, and what parallelism bought.

``speedup`` is the sum of stage durations over the wall time; ``critical_path_s`` is the
longest dependent chain, the Amdahl bound no executor can beat.

A run that is interrupted (Ctrl-C, SIGTERM) writes its record with status ``interrupted``
itself. A run that is killed (kill -9, the machine going down) cannot: while it runs, its
record says ``running`` and each stage's start and end is appended to an events file
beside it (a line each, so a long pipeline pays no rewrite per stage); the next command
that takes the run lock finds the record still ``running`` and settles it from the
events (:func:`settle_killed_run`): stages that had ended keep their outcome, those that
were running are ``interrupted``.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from conveyor.errors import UNWRITABLE, redact
from conveyor.plan import dag
from conveyor.run.logs import logs_dir
from conveyor.run.schedule import Outcome
from conveyor.workspace import STATE_DIR, replace_atomically, state_dir

if TYPE_CHECKING:
    from conveyor.spec.project import Project

RUNNING = "running"  # a run's or a stage's status while it runs
INTERRUPTED = "interrupted"  # stopped by Ctrl-C, SIGTERM, or killed (recorded by the next command)
IN_PROCESS = "in process"  # how a stage's placement starts when it ran in the runner's process
_V = TypeVar("_V")


def begin(project: Project, selected: Iterable[str], run_id: str | None = None,
          overrides: Mapping[str, Any] | None = None, **fields: Any) -> RunRecord:
    """The record of a run of ``selected`` stages as it starts: every stage ``not_run`` yet, with
    its matrix item, and the params its stages read as they are now (``conveyor compare`` shows them)."""
    chosen = set(selected)
    stages = [s for s in project.order if s in chosen]
    params: dict[str, Any] = {}
    for stage in stages:
        params.update(project.stage_params(stage))
    run = RunRecord(run_id or new_run_id(), project.pipeline.pipeline, spec=project.rel(project.spec_path),
                    overrides=_redacted(dict(overrides or {})),
                    params=_redacted(dict(sorted(params.items()))), **fields)
    run.stages = {s: StageRecord(item=_redacted(project.item_of(s))) for s in stages}
    return run


def _redacted(value: _V) -> _V:
    """``value`` with the credentials of every URL in its strings replaced (a source list is a param)."""
    if isinstance(value, str):
        return cast(_V, redact(value))
    if isinstance(value, dict):
        return cast(_V, {k: _redacted(v) for k, v in value.items()})
    if isinstance(value, list):
        return cast(_V, [_redacted(v) for v in value])
    return value


def now() -> datetime:
    return datetime.now(UTC)


def new_run_id() -> str:
    return f"{now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


INPUTS_CHANGED = "changed while it ran, recorded as it started (so it is stale: run again)"


@dataclass
class StageRecord:
    """How one stage went in one run."""

    status: str = Outcome.NOT_RUN.value
    profile: str | None = None
    placement: str | None = None  # in process or on the workers, and why (a profile with in_process_below)
    attempts: int = 0
    reason: str = ""
    started: str | None = None
    finished: str | None = None
    duration_s: float = 0.0
    error: str | None = None
    trace: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # from its declared metrics files
    item: dict[str, Any] | None = None  # the matrix item of this stage, if it has one
    deterministic: dict[str, str] | None = None  # the pinned environment it ran with (deterministic: true)
    packages: dict[str, str] | None = None  # distribution -> version, of the packages its code imports
    cpu: dict[str, str] | None = None  # the CPU's instruction-set level, threads, kernel variables set
    inputs_changed: list[str] = field(default_factory=list)  # deps/params changed while it ran: stale after it
    held: dict[str, Any] | None = None  # the Dask workers it held for its resources, from and until when
    resumed: dict[str, Any] | None = None  # the checkpoint it resumed: step, total, unit, run_id, wall_s, saved_s

    @property
    def where(self) -> str:
        """The profile as the live view and summary show it: ``cpu``, or ``cpu (in process)``."""
        in_process = self.placement is not None and self.placement.startswith(IN_PROCESS)
        return f"{self.profile or ''}{' (in process)' if in_process else ''}"


@dataclass
class RunRecord:
    """One ``conveyor run``, written to ``.conveyor/runs/<run_id>.json`` and ``latest.json``."""

    run_id: str
    pipeline: str
    status: str = "running"
    reason: str = ""  # why the run failed when no stage did (its Prefect server stopped answering)
    started: str = field(default_factory=lambda: now().isoformat())
    finished: str | None = None
    wall_s: float = 0.0
    spec: str = ""  # the spec file, relative to the project root (``conveyor compare`` picks its runs)
    overrides: dict[str, Any] = field(default_factory=dict)  # ``-S key=value`` of this run
    params: dict[str, Any] = field(default_factory=dict)  # the declared params of its stages, as they ran
    stages: dict[str, StageRecord] = field(default_factory=dict)
    critical_path: list[str] = field(default_factory=list)
    critical_path_s: float = 0.0
    stage_sum_s: float = 0.0
    speedup: float = 0.0
    flow_run_id: str | None = None
    flow_run_url: str | None = None  # in the Prefect UI, when a server is configured
    search: dict[str, Any] | None = None  # a search's: stage, study, objective, metric, minimize, best trial

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.status == Outcome.FAILED.value]

    @property
    def not_run(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.status == Outcome.NOT_RUN.value]

    @property
    def interrupted(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.status == INTERRUPTED]

    def close(self, graph: dag.Graph, wall_s: float, *, interrupted: bool = False) -> None:
        """Fill in the totals once every stage has ended (or the run was interrupted)."""
        self.finished = now().isoformat()
        self.wall_s = round(wall_s, 3)
        if interrupted or self.interrupted:
            self.status = INTERRUPTED
            for stage in self.stages.values():
                if stage.status == Outcome.NOT_RUN.value and not stage.reason:
                    stage.reason = "the run was interrupted before it started"
        else:
            self.status = "failed" if self.failed or self.not_run else "succeeded"
        durations = {n: s.duration_s for n, s in self.stages.items()}
        sub = {n: frozenset(u for u in graph[n] if u in durations) for n in durations}
        self.critical_path, cp = dag.critical_path(sub, durations)
        self.critical_path_s = round(cp, 3)
        self.stage_sum_s = round(sum(durations.values()), 3)
        self.speedup = round(self.stage_sum_s / self.wall_s, 3) if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        body = dict(data)
        body["stages"] = {n: StageRecord(**s) for n, s in body.get("stages", {}).items()}
        return cls(**body)

    def write(self, root: Path) -> Path:
        """Write this record and point latest.json at it; both writes are atomic.

        A record that is no longer ``running`` has no use for its events file: it goes.
        """
        path = record_path(root, self.run_id)
        folder = path.parent
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2)
        for target in (path, folder / "latest.json"):
            replace_atomically(target, text + "\n")
        if self.status != RUNNING:
            events_path(root, self.run_id).unlink(missing_ok=True)
        return path


class RunEvents:
    """The events file of a running run: one JSON line per stage start and end, appended."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.path = events_path(root, run_id)
        self._lock = threading.Lock()

    def stage(self, stage: str, record: StageRecord) -> None:
        """Append the line; on a full disk it is lost, not the run: the events serve only to settle a
        killed run, and the stages still running must end (and be recorded in dvc.lock) as they would."""
        line = json.dumps({"stage": stage, **{k: v for k, v in asdict(record).items() if k != "trace"}})
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise


def _last_sign_of_life(root: Path, run: RunRecord) -> str:
    """When a killed run last wrote anything: its events file or its logs (stages log as they go)."""
    folder = logs_dir(root, run.run_id)
    written = [p for p in (events_path(root, run.run_id), *(folder.iterdir() if folder.is_dir() else ())) if p.exists()]
    if not written:
        return run.started
    latest = datetime.fromtimestamp(max(p.stat().st_mtime for p in written), UTC)
    return max(latest, datetime.fromisoformat(run.started)).isoformat()


def events_path(root: Path, run_id: str) -> Path:
    return state_dir(root) / "runs" / f"{run_id}.events"


def settle_killed_run(root: Path) -> RunRecord | None:
    """The last run, if it was killed (its record still says ``running``): recorded as
    interrupted from its events, and returned; None when it ended on its own.

    Call it holding the run lock: a record that says ``running`` is then one whose run is gone.
    """
    run = read_latest(root)
    if run is None or run.status != RUNNING:
        return None
    events = events_path(root, run.run_id)
    last_seen = _last_sign_of_life(root, run)
    if events.exists():
        for line in events.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
                name = event.pop("stage")
            except (ValueError, KeyError):
                continue  # the line being written when the run was killed
            known = run.stages.get(name) or StageRecord()  # a search's trials are known by their events only
            run.stages[name] = StageRecord(**{**asdict(known), **event})
    for stage in run.stages.values():
        if stage.status == RUNNING:
            stage.status, stage.finished = INTERRUPTED, last_seen
            # a kill can land after the stage recorded its outs (dvc.lock) and before its end event
            stage.error = ("the run was killed while this stage ran: its outs are whole, the previous ones or, "
                           "where it had just recorded them, its new ones")
        elif stage.status == Outcome.NOT_RUN.value and not stage.reason:
            stage.reason = "the run was killed before it started"
    run.status, run.finished = INTERRUPTED, last_seen
    run.wall_s = round((datetime.fromisoformat(last_seen) - datetime.fromisoformat(run.started)).total_seconds(), 3)
    run.write(root)
    return run


def read(root: Path, run_id: str) -> RunRecord | None:
    """The record of run ``run_id``; None when it wrote none (or it cannot be read)."""
    try:
        return _parse(root / STATE_DIR / "runs" / f"{run_id}.json")
    except (OSError, ValueError, TypeError):
        return None


def close_before_flow(project: Project, run_id: str, *, interrupted: bool, why: str = "") -> RunRecord | None:
    """The record of run ``run_id``, closed if it still says ``running``: the run stopped before its
    flow began (Ctrl-C, or its server did not start), so no stage ran; ``why`` becomes each stage's
    reason. None when the run wrote no record."""
    run = read(project.root, run_id)
    if run is not None and run.status == RUNNING:
        for stage in run.stages.values():
            stage.reason = stage.reason or why
        run.close(project.graph, (now() - datetime.fromisoformat(run.started)).total_seconds(), interrupted=interrupted)
        run.reason = why
        run.write(project.root)
    return run


def fail_run(project: Project, run_id: str, why: str) -> RunRecord | None:
    """The record of run ``run_id``, failed for ``why``, a cause outside its stages (the Prefect server
    it records in stopped answering): each stage keeps the outcome it had, and one that never
    started gets ``why`` as its reason. None when the run wrote no record."""
    run = close_before_flow(project, run_id, interrupted=False, why=why)
    if run is not None:
        run.status, run.reason = "failed", why
        run.write(project.root)
    return run


def record_path(root: Path, run_id: str) -> Path:
    return state_dir(root) / "runs" / f"{run_id}.json"


def read_latest(root: Path) -> RunRecord | None:
    path = root / STATE_DIR / "runs" / "latest.json"
    if not path.exists():
        return None
    return _parse(path)


def _parse(path: Path) -> RunRecord:
    return RunRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))


# ------------------------------------------------------------------- past runs

_RUN_FIELDS = frozenset(f.name for f in fields(RunRecord))
_STAGE_FIELDS = frozenset(f.name for f in fields(StageRecord))
_DICTS = {"overrides", "params", "stages"}  # run fields that must be mappings to be read


def runs_dir(root: Path) -> Path:
    return root / STATE_DIR / "runs"  # not record_path's: reading past runs makes no directory


def load_runs(root: Path) -> tuple[list[RunRecord], list[Path]]:
    """Every readable run record of the project, oldest first, and the files that could not be read."""
    runs: list[RunRecord] = []
    unreadable: list[Path] = []
    for path, run in _records(root):
        if run is None:
            unreadable.append(path)
        else:
            runs.append(run)
    return sorted(runs, key=lambda r: (_started(r), r.run_id)), unreadable


def newest_runs(root: Path) -> Iterator[RunRecord]:
    """The project's readable run records, newest first, read one at a time: a caller that wants the
    latest few stops there (a run asks what its stages ran in last; reading every record cost a
    trivial run 0.05 CPU-s at 800 records, and grew with the history). Newest by name: a run id
    begins with its start time in UTC (:func:`new_run_id`), to the second."""
    return (run for _, run in _records(root, newest_first=True) if run is not None)


def _records(root: Path, *, newest_first: bool = False) -> Iterator[tuple[Path, RunRecord | None]]:
    """Each record file of the project in the order of its name, read as it is reached: None for one
    that cannot be read as a record."""
    folder = runs_dir(root)
    for path in sorted(folder.glob("*.json"), reverse=newest_first) if folder.is_dir() else []:
        if path.name == "latest.json":  # a copy of the last run's record
            continue
        try:
            yield path, parse_record(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, AttributeError):
            yield path, None


def parse_record(data: Any) -> RunRecord:
    """A record from its JSON, ignoring fields this version does not know; ValueError when it is
    not a record (a run id that is no string, metrics that are no mapping)."""
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str) or \
            any(not isinstance(data.get(k, {}), dict) for k in _DICTS):
        raise ValueError("not a run record")
    body = {k: v for k, v in data.items() if k in _RUN_FIELDS}
    body["stages"] = {name: {k: v for k, v in stage.items() if k in _STAGE_FIELDS}
                      for name, stage in body.get("stages", {}).items()}
    run = RunRecord.from_dict(body)
    if not (isinstance(run.status, str) and isinstance(run.started, str) and _number(run.wall_s)) or \
            any(not isinstance(s.metrics, dict) or not isinstance(s.item, dict | None) for s in run.stages.values()):
        raise ValueError("not a run record")
    return run


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _started(run: RunRecord) -> datetime:
    try:
        when = datetime.fromisoformat(run.started)
    except (TypeError, ValueError):
        return datetime.min.replace(tzinfo=UTC)
    return when if when.tzinfo else when.replace(tzinfo=UTC)
