"""What a run decides before anything heavy starts: the run lock, the record, the plan.

``conveyor run`` opens a :class:`RunSession` first (no Prefect, no Dask, no server): it
holds the project's run lock and the record's session (DVC's repository lock for a DVC
record), puts back the outs of a killed run, and asks the record which selected stages
are due. When none is, the run ends there (:func:`nothing_to_do`). Otherwise the flow's
scheduling loop runs under the very same session, so what was decided is what runs, and
nobody can change the record in between.

A stage downstream of one that is due is not asked at planning time: whether it runs is
known only once its upstream has run (DVC's rule: an upstream that rewrote its outs with
the same content leaves its dependents up to date). :meth:`RunSession.due` asks then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ProfileError, RunLockedError, UnwritableError
from conveyor.plan import dag
from conveyor.plan.fingerprint import Record
from conveyor.run.journal import KEPT_RECORDED, RECOVERED, Journal
from conveyor.run.leftovers import end_killed_runs
from conveyor.run.metrics import stage_metrics
from conveyor.run.profiles import Profiles
from conveyor.run.record import RUNNING, RunRecord, begin, now, read_latest, settle_killed_run
from conveyor.run.schedule import Outcome
from conveyor.spec.project import Project
from conveyor.workspace import run_holder, run_lock

UP_TO_DATE = "up to date"
IN_PROGRESS = "a run is in progress (pid {pid}): this is the state before it, with the stages it has finished so far"
KILLED = "the last run ({run}) was killed while {stages} ran: recorded as interrupted"


@dataclass(frozen=True)
class RunOptions:
    """What to run: a selection of stages (``dvc repro`` semantics), forced or not.

    ``force_downstream``: a stage whose upstream ran in this run runs too, changed or not
    (``dvc repro --force-downstream``: an upstream that rewrote its outs with the same bytes
    would otherwise leave it up to date)."""

    stages: tuple[str, ...] = ()
    downstream: bool = False
    force: bool = False
    profiles: Mapping[str, str] = field(default_factory=dict)
    forced: tuple[str, ...] = ()  # run these even when up to date (retraining re-ingests)
    single: bool = False  # the named stages alone, not their upstream (dvc repro -s)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # -S key=value, already in the params file
    force_downstream: bool = False
    pipeline: bool = False  # the whole pipelines of the named stages (dvc repro -p)
    all_pipelines: bool = False  # every dvc.yaml of the repository (dvc repro -P): in the project loaded
    no_commit: bool = False  # outs not put into the DVC cache, no run cache entry (dvc repro --no-commit)
    allow_missing: bool = False  # skip a stage whose only change is missing data (dvc repro --allow-missing)
    no_run_cache: bool = False  # restore outs from dvc.lock's entry only, not the run cache (dvc repro --no-run-cache)
    pull: bool = False  # missing data and the run cache from the DVC remote (dvc repro --pull)

    def selected(self, graph: dag.Graph) -> set[str]:
        return dag.select(graph, self.stages, downstream=self.downstream, single=self.single,
                          pipeline=self.pipeline)


def check_options(project: Project, options: RunOptions) -> None:
    """Unknown stages or profiles in ``options``: a UsageError before anything runs."""
    project.expand([*options.stages, *options.forced])  # raises on unknown stage names
    Profiles(project.pipeline.profiles, options.profiles)  # raises on unknown profile names


@dataclass(frozen=True)
class ForcedRecord:
    """A record that calls ``forced`` stages stale whatever their fingerprint; the rest as ``inner`` says."""

    inner: Record
    forced: frozenset[str]

    def session(self) -> AbstractContextManager[Any]:
        return self.inner.session()

    def reasons(self, stage: str) -> list[str]:
        return ["forced"] if stage in self.forced else self.inner.reasons(stage)

    def reload(self) -> None:
        self.inner.reload()

    def prepare(self, stage: str) -> None:
        self.inner.prepare(stage)

    def restore(self, stage: str) -> bool:
        return stage not in self.forced and self.inner.restore(stage)

    def save(self, stage: str) -> list[str]:
        return self.inner.save(stage)


@dataclass
class RunSession:
    """A run's decisions, held under its locks: which selected stages are due, and why.

    ``planned[stage]`` is a stage's own reasons when nothing upstream of it is due (empty:
    up to date), or None when something upstream is due, so its fate waits for that run.
    """

    project: Project
    options: RunOptions
    record: Record
    selected: set[str]
    planned: dict[str, list[str] | None]
    recovered: list[str] = field(default_factory=list)
    ran: set[str] = field(default_factory=set)  # stages that ran (not skipped) in this run

    @property
    def nothing_to_do(self) -> bool:
        return not any(reasons is None or reasons for reasons in self.planned.values())

    def due(self, stage: str) -> list[str]:
        """Why ``stage`` runs now that its upstream has ended; empty: it is skipped.

        Asked when the stage is ready: a stage whose upstream ran is asked again then,
        as ``dvc repro`` asks each stage in turn; the others keep the planned answer.
        """
        if self.options.force:
            return ["forced"]
        if self.options.force_downstream and any(u in self.ran for u in self.project.graph[stage]):
            return ["forced: its upstream ran (--force-downstream)"]
        planned = self.planned[stage]
        if planned is not None and not any(u in self.ran for u in self.project.graph[stage]):
            return planned
        return self.record.reasons(stage)


def recover_killed(project: Project, warn: Callable[[str], None], *, settle: bool = True) -> list[str]:
    """What a killed run left behind: the previous outs of its stages put back (unless the outs
    in their place are the ones the project's record holds now: written and recorded after the
    kill, by ``dvc repro`` or that run itself) and, with ``settle`` (the caller holds the run
    lock), its record settled as interrupted. ``warn`` hears each; returns the stages whose
    outs were put back."""
    from conveyor.dvc.vouched import recorded_in_place

    root = project.root
    recovered = Journal(root).recover(recorded_in_place(project))
    for stage in recovered.restored:
        warn(RECOVERED.format(stage=stage))
    for stage in recovered.kept:
        warn(KEPT_RECORDED.format(stage=stage))
    killed = settle_killed_run(root) if settle else None
    if killed is not None:
        warn(KILLED.format(run=killed.run_id, stages=", ".join(killed.interrupted) or "no stage"))
        if ended := end_killed_runs(killed.run_id, root):
            warn(f"ended {len(ended)} process{'es' if len(ended) > 1 else ''} the killed run had left running: "
                 f"{', '.join(ended)}")
    return recovered.restored


def recover_for_question(project: Project, warn: Callable[[str], None]) -> None:
    """Before ``status`` or ``run --dry-run``: put back the previous outs of stages whose run was
    killed, and settle its record, unless a run is going on (then say so: the answer is the state
    before it). Where nothing can be written (a read-only checkout), nothing is recovered: the
    question is answered all the same, from the workspace as it is."""
    try:
        with run_lock(project.root):
            recover_killed(project, warn)
    except RunLockedError as exc:  # a run is going on: its record is its own (its stages' entries stay locked)
        warn(IN_PROGRESS.format(pid=exc.pid or "unknown"))
        recover_killed(project, warn, settle=False)
    except UnwritableError as exc:  # read-only: a run elsewhere, or what a killed one left, is all it can say
        pid = run_holder(project.root)
        if pid is not None:
            warn(IN_PROGRESS.format(pid=pid))
        elif left_by_killed(project):
            warn(f"a killed run's outs and record are left as they are: {exc.filename} cannot be written "
                 f"({exc.strerror})")


def left_by_killed(project: Project) -> bool:
    """Whether a killed run left anything for :func:`recover_killed` (outs in the journal, a record
    that says running); read only, for a checkout where nothing can be written."""
    journal = Journal(project.root)
    entries = [f for f in journal.folder.iterdir() if not f.name.startswith(".")] if journal.folder.is_dir() else []
    try:
        latest = read_latest(project.root)
    except (OSError, ValueError, TypeError):
        latest = None
    return len(entries) > len(journal.running()) or (latest is not None and latest.status == RUNNING)


@contextmanager
def open_session(project: Project, options: RunOptions, warn: Callable[[str], None] = lambda _line: None,
                 *, write: Callable[[], None] | None = None) -> Iterator[RunSession]:
    """Take the run lock and the record's session, recover killed outs, plan; nothing heavy.

    ``warn`` hears each out put back from a killed run. ``write``: what the run writes once it
    holds its locks, before it plans (the ``-S`` values into the params file): a run refused
    (another run, ``dvc repro``) has written nothing. ``project`` was read with those values.
    """
    from conveyor.dvc.record import open_record

    record: Record = open_record(project, no_commit=options.no_commit, allow_missing=options.allow_missing,
                                 no_run_cache=options.no_run_cache, pull=options.pull)
    if options.forced:
        record = ForcedRecord(record, frozenset(options.forced))
    selected = options.selected(project.graph)
    with run_lock(project.root), record.session():
        if write is not None:
            write()
            record.reload()
        recovered = recover_killed(project, warn)
        _settle_sources(project, record, options, selected)
        planned: dict[str, list[str] | None] = {}
        for stage in project.order:
            if stage not in selected:
                continue
            if options.force:
                planned[stage] = ["forced"]
            elif any(planned.get(u) is None or planned.get(u) for u in project.graph[stage] if u in planned):
                planned[stage] = None
            else:
                planned[stage] = record.reasons(stage)
        yield RunSession(project, options, record, selected, planned, recovered)


def _settle_sources(project: Project, record: Record, options: RunOptions, selected: set[str]) -> None:
    """What ``dvc repro`` settles before the first stage of a dvc.yaml: a dep that no stage writes
    and is missing fails the run now (nothing has run); the ``dvc add``ed data the selected stages
    read is committed where it changed (not with ``-s`` or ``--downstream``: ``dvc repro`` then
    leaves the upstream ``.dvc`` files alone)."""
    if project.dvc is None:
        return
    from conveyor.dvc.sources import check_unmade

    check_unmade(project, [stage for stage in project.order if stage in selected])
    commit = getattr(getattr(record, "inner", record), "commit_sources", None)  # a ForcedRecord wraps it
    if commit is not None and not (options.single or options.downstream):
        commit([stage for stage in project.order if stage in selected], force=options.force)


def nothing_to_do(session: RunSession, run_id: str | None = None) -> RunRecord:
    """The record of a run in which every selected stage is up to date: written, nothing started."""
    t0 = time.monotonic()
    project = session.project
    run = begin(project, session.selected, run_id, session.options.overrides)
    profiles = Profiles(project.pipeline.profiles, session.options.profiles)  # names only: nothing starts
    stamp = now().isoformat()
    for name, stage in run.stages.items():
        stage.status, stage.reason, stage.started, stage.finished = Outcome.SKIPPED.value, UP_TO_DATE, stamp, stamp
        stage.profile = _profile(profiles, project.pipeline.stages[name].on)
        stage.metrics = stage_metrics(project.root, project.metrics_of(name))
    run.close(project.graph, time.monotonic() - t0)
    run.write(project.root)
    return run


def _profile(profiles: Profiles, on: str | None) -> str:
    """The profile a skipped stage would have run on; as declared where it could not (no GPU, no fallback)."""
    try:
        return profiles.resolve(on) or "local"
    except ProfileError:
        return on or "local"
