"""``conveyor search``: Optuna proposes trials, the stage's profile runs them, the study keeps them.

One thread per slot of the stage's profile (never more trials at once than it has workers)
drives ask → run → tell: Optuna's ask-and-tell interface, so the stage's own runner does the
work (:mod:`conveyor.run.trials`) and Optuna only proposes. The study is kept in a journal
file under ``.conveyor/search/<study>/`` (Optuna's JournalStorage: appended, safe against a
kill): a search run again with the same stage, space, objective and sampler continues it
until ``--trials`` have finished. Trials that were running when a search was stopped
(Ctrl-C, a kill) are marked failed and interrupted, and not counted: the next search runs
them again. Optuna is imported here only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError
from conveyor.run.compare import flatten
from conveyor.run.profiles import Profiles
from conveyor.run.record import INTERRUPTED, RunEvents, RunRecord, StageRecord, begin
from conveyor.run.reporting import Listener
from conveyor.run.schedule import Outcome
from conveyor.run.stage import StageEvents
from conveyor.run.trials import PRUNED, Trials, study_dir, trial_name
from conveyor.spec.project import Project
from conveyor.spec.search import Search, current, grid_of
from conveyor.workspace import run_lock

if TYPE_CHECKING:
    import optuna

JOURNAL = "journal.log"
# a trial's user attribute: why its stage failed. A failed trial without it was running when a
# search was stopped: it does not count, and the next search draws another in its place
ERROR = "error"
GRACE_S = 3.0  # for the running trials to stop after Ctrl-C (as a run's stages get)
WAIT_S = 0.2  # the main thread waits in slices: a signal's handler runs only there


class SearchFailed(ConveyorError):
    """Optuna, or its study's journal, failed under a search (not a trial: a trial's failure is its own)."""


@dataclass
class Finished:
    """One finished trial of the study, as the summary and ``compare`` show it."""

    number: int
    values: dict[str, Any]
    value: float | None  # the objective; None for a failed or pruned trial
    error: str = ""
    pruned: bool = False


@dataclass
class Outcomes:
    """What a search did: this run's record, and every finished trial of its study."""

    run: RunRecord
    trials: list[Finished] = field(default_factory=list)
    already: int = 0  # trials the study had finished before this search began
    stopped: KeyboardInterrupt | None = None  # Ctrl-C or SIGTERM stopped it (the running trials recorded)

    def ranked(self, minimize: bool) -> list[Finished]:
        """Trials with a value, best first (then the failed ones)."""
        done = sorted((t for t in self.trials if t.value is not None),
                      key=lambda t: (t.value if minimize else -(t.value or 0.0), t.number))
        return done + [t for t in self.trials if t.value is None]


def slots(project: Project, profiles: Profiles, stage: str) -> int:
    """How many trials may run at once: the workers of the stage's profile (threads: its
    ``max_workers``; no profile: the cores), started only when its size is not in the spec."""
    from conveyor.spec.profiles import DaskProfile, ThreadsProfile

    name = profiles.resolve(project.pipeline.stages[stage].on)
    if name is None:
        return os.cpu_count() or 1
    profile = project.pipeline.profiles.get(name)
    if isinstance(profile, ThreadsProfile):
        return profile.max_workers
    if isinstance(profile, DaskProfile) and profile.n_workers is not None and profile.address is None:
        return profile.n_workers
    return max(1, profiles.get(name).n_workers)


def metric_key(project: Project, search: Search) -> str:
    """The objective as the run record's metrics name it (``rmse``, or ``metrics/x.json:rmse`` when
    the stage has several metrics files)."""
    several = len(project.metrics_of(search.stage)) > 1
    return search.objective.shown if several else search.objective.key


def open_study(project: Project, search: Search) -> optuna.Study:
    """The study on disk, made or continued; trials a stopped search left running are settled."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its lines would run over the summary
    folder = study_dir(project.root, search.study)
    folder.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(folder / JOURNAL)))
    pruner = optuna.pruners.MedianPruner() if search.prune else optuna.pruners.NopPruner()
    study = optuna.create_study(study_name=search.study, storage=storage, sampler=_sampler(search), pruner=pruner,
                                direction="minimize" if search.objective.minimize else "maximize",
                                load_if_exists=True)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):  # a killed search's
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    return study


def _sampler(search: Search) -> optuna.samplers.BaseSampler:
    import optuna

    if search.sampler == "grid":
        return optuna.samplers.GridSampler(grid_of(search.space), seed=search.seed)
    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=search.seed)
    startup = min(10, max(3, search.trials // 3))  # TPE guides the rest: a third of a short search
    return optuna.samplers.TPESampler(seed=search.seed, n_startup_trials=startup, constant_liar=True)


def distributions(search: Search) -> dict[str, optuna.distributions.BaseDistribution]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made: dict[str, optuna.distributions.BaseDistribution] = {}
    for d in search.space:
        if d.kind == "int":
            made[d.key] = IntDistribution(int(d.low), int(d.high))
        elif d.kind == "choice":
            made[d.key] = CategoricalDistribution(d.choices)
        else:
            made[d.key] = FloatDistribution(d.low, d.high, log=d.kind == "loguniform")
    return made


def finished(study: optuna.Study) -> list[Finished]:
    """The study's trials that ended on their own (succeeded or failed), in order."""
    import optuna

    state = optuna.trial.TrialState
    return [Finished(t.number, dict(t.params), t.value if t.state == state.COMPLETE else None,
                     str(t.user_attrs.get(ERROR, "")), t.state == state.PRUNED)
            for t in study.get_trials(deepcopy=False, states=(state.COMPLETE, state.FAIL, state.PRUNED))
            if t.state != state.FAIL or ERROR in t.user_attrs]


def _first_point(project: Project, search: Search, study: optuna.Study) -> None:
    """The params file's point is the study's first trial, where it lies in the space: every trial
    is then measured against what the project has now. Once: unless a trial ran it, or waits to
    (a search stopped before it ran draws it again when it continues)."""
    import optuna

    point = dict(current(project, search.space))
    inside = all((d.choices and point[d.key] in d.choices) or
                 (not d.choices and isinstance(point[d.key], int | float) and d.low <= point[d.key] <= d.high)
                 for d in search.space)
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    if inside and search.sampler != "grid" and not waiting and all(t.values != point for t in finished(study)):
        study.enqueue_trial(point)


def run_search(project: Project, search: Search, run_id: str, view: StageEvents, *,
               swaps: Mapping[str, str] | None = None, heard: Callable[[str, StageRecord], None] | None = None,
               warn: Callable[[str], None] = lambda _line: None) -> Outcomes:
    """Run the search to ``search.trials`` finished trials (or its timeout); ``heard`` hears each
    trial end. Ctrl-C stops the running trials and records them interrupted (``stopped`` says so).

    Under the run lock, as a run: no run changes the deps under the trials' feet, and what a
    killed run (or search) left is recovered first (``warn`` hears what)."""
    from conveyor.run.session import recover_killed

    with run_lock(project.root):
        recover_killed(project, warn)
        study = open_study(project, search)
        before = finished(study)
        todo = search.trials - len(before)
        if search.sampler == "grid":
            todo = min(todo, _grid_size(search) - len(before))
        run = begin(project, [], run_id, search={"stage": search.stage, "study": search.study,
                                                 "objective": search.objective.shown,
                                                 "metric": f"{search.stage}:{metric_key(project, search)}",
                                                 "minimize": search.objective.minimize})
        searched = {d.key for d in search.space}  # each trial's values are its item's
        run.params = {k: v for k, v in flatten(project.stage_params(search.stage)).items() if k not in searched}
        outcomes = Outcomes(run, already=len(before))
        if todo > 0:
            _first_point(project, search, study)
            run.write(project.root)
            try:
                with Profiles(project.pipeline.profiles, swaps) as profiles:
                    loop = _Loop(project, search, study, Trials(project, search, profiles, run, view), todo, heard)
                    loop.run(slots(project, profiles, search.stage))
            except KeyboardInterrupt as exc:  # the running trials are recorded interrupted; the caller exits
                outcomes.stopped = exc
        outcomes.trials = finished(study)
        if todo > 0:  # a study that has its trials already ran nothing: no record
            run.search = {**(run.search or {}), "best": _best(outcomes, search)}
            run.write(project.root)
        return outcomes


def _grid_size(search: Search) -> int:
    size = 1
    for values in grid_of(search.space).values():
        size *= len(values)
    return size


def _best(outcomes: Outcomes, search: Search) -> str | None:
    ranked = outcomes.ranked(search.objective.minimize)
    return trial_name(search.stage, ranked[0].number) if ranked and ranked[0].value is not None else None


class _Loop:
    """The slots of one search: each thread asks for a trial, runs it, tells its value, until
    ``todo`` trials were asked for (or the timeout passed)."""

    def __init__(self, project: Project, search: Search, study: optuna.Study, trials: Trials, todo: int,
                 heard: Callable[[str, StageRecord], None] | None) -> None:
        self.project, self.search, self.study, self.trials, self.todo = project, search, study, trials, todo
        self.heard = heard
        self.asked = 0
        self.deadline = time.monotonic() + search.timeout_s if search.timeout_s else None
        self.running: dict[int, str] = {}  # trial number -> its name, while it runs
        self.stop = threading.Event()
        self.failure: Exception | None = None  # what stopped a slot other than its trial (Optuna, its journal)
        self._mutex = threading.Lock()  # Optuna's study and sampler, and the run record, one thread at a time
        self._space = distributions(search)
        self.events = RunEvents(project.root, trials.run.run_id)
        self._t0 = time.monotonic()

    def run(self, n: int) -> None:
        threads = [threading.Thread(target=self._slot, name=f"search-slot-{i}", daemon=True)
                   for i in range(max(1, min(n, self.todo)))]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(WAIT_S)
        except KeyboardInterrupt:
            self._interrupted(threads)
            raise
        finally:
            self._close(interrupted=self.stop.is_set() and self.failure is None)
        if self.failure is not None:
            from conveyor.run.failures import short_error

            raise SearchFailed(f"the search stopped: {short_error(self.failure)} (the trials that finished are in "
                               f"its study; the same command continues it)") from self.failure

    def _slot(self) -> None:
        try:
            while (trial := self._ask()) is not None:
                record = self.trials.run_trial(trial.number, trial.params, self._listener(trial))
                with self._mutex:
                    if self.stop.is_set():  # interrupted: the main thread records it
                        return
                    self._tell(trial, record)
                    self.running.pop(trial.number, None)
                self.events.stage(trial_name(self.search.stage, trial.number), record)  # a killed search's record
                if self.heard is not None:
                    self.heard(trial_name(self.search.stage, trial.number), record)
        except KeyboardInterrupt:  # Ctrl-C, raised in this thread by the stage runner: the main thread records it
            return
        except Exception as exc:  # noqa: BLE001 - Optuna or its journal failed: the search stops, said in one line
            self.failure = exc
            self.stop.set()

    def _ask(self) -> optuna.Trial | None:
        with self._mutex:
            late = self.deadline is not None and time.monotonic() >= self.deadline
            if self.stop.is_set() or self.asked >= self.todo or late:
                return None
            self.asked += 1
            trial = self.study.ask(self._space)
            self.running[trial.number] = trial_name(self.search.stage, trial.number)
            return trial

    def _listener(self, trial: optuna.Trial) -> Listener | None:
        """What hears a trial's ``ctx.report`` when the search prunes: Optuna's pruner decides."""
        if not self.search.prune:
            return None

        def heard(step: int, value: float) -> bool:
            with self._mutex:
                trial.report(value, step)
                return trial.should_prune()

        return heard

    def _tell(self, trial: optuna.Trial, record: StageRecord) -> None:
        import optuna

        key = metric_key(self.project, self.search)
        try:
            if record.status == Outcome.SUCCEEDED.value and key in record.metrics:
                self.study.tell(trial, record.metrics[key])
                return
            trial.set_user_attr(ERROR, record.error or "failed")
            pruned = record.status == PRUNED
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED if pruned else optuna.trial.TrialState.FAIL)
        except RuntimeError:  # the grid sampler stops a study whose grid is done: outside optimize()
            if self.search.sampler != "grid":  # that raises, once the trial is stored
                raise

    def _interrupted(self, threads: list[threading.Thread]) -> None:
        """Ctrl-C: stop the running trials (grace: a few seconds), record them interrupted in the run
        record and failed in the study, where they do not count: the next search draws others."""
        import optuna

        self.stop.set()
        self.trials.interrupt()
        deadline = time.monotonic() + GRACE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._mutex:
            for number, name in self.running.items():
                self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                stage = self.trials.run.stages.get(name)
                if stage is not None:
                    stage.status, stage.error = INTERRUPTED, "interrupted: the next search draws another"
            self.running.clear()

    def _close(self, *, interrupted: bool) -> None:
        with self._mutex:
            run = self.trials.run
            run.close({name: frozenset() for name in run.stages}, time.monotonic() - self._t0,
                      interrupted=interrupted)
            run.write(self.project.root)
