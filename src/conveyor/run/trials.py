"""One trial of a search: the stage's own body, with the trial's params, in a folder of its own.

A trial must not touch the project: not params.yaml (a search is no ``-S``), not the stage's
outs (the project's model stays the one dvc.lock records). So each trial runs in
``.conveyor/search/<study>/trial-<n>/``, a folder made to look like the project root: every
top-level entry is a symlink to the project's, except the stage's outs and metrics (the
trial writes its own there) and the params file (the trial's copy, with its values set); its
``.conveyor`` is the study's (the runner's journal and checkpoints; its log goes to the
project's ``.conveyor/logs``, as a stage's).
A ``cmd`` runs there with its paths as written; a task gets that folder as its root. The
stage runs through the one stage runner (:class:`conveyor.run.stage.StageRunner`): its
profile, placement, pinned environment, logs and timeouts are a run's. When the trial
ends, the symlinks go; its outs, metrics and params stay.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from conveyor.run import environment
from conveyor.run.failures import short_error
from conveyor.run.metrics import read_metrics, stage_metrics
from conveyor.run.profiles import Profiles
from conveyor.run.record import INTERRUPTED, RunRecord, StageRecord, now
from conveyor.run.reporting import Listener, TrialPruned, listening
from conveyor.run.schedule import Outcome
from conveyor.run.stage import StageEvents, StageRunner
from conveyor.spec.matrix import JOIN
from conveyor.spec.overrides import Override, rendered
from conveyor.spec.project import Project, load_project, lookup
from conveyor.spec.search import Search, as_param
from conveyor.workspace import STATE_DIR, state_dir

PRUNED = "pruned"  # a trial's status when the search stopped it on its reports

NOT_LINKED = frozenset({".git", ".dvc", ".conveyor", "dvc.yaml", "dvc.lock", ".dvcignore"})


def study_dir(root: Path, study: str) -> Path:
    """Where a study keeps its journal and its trials' folders."""
    return state_dir(root) / "search" / study


def trial_name(stage: str, number: int) -> str:
    """A trial as the run record names it, as a matrix item is named: ``train@trial-3``."""
    return f"{stage}{JOIN}trial-{number}"


def overlay(root: Path, folder: Path, private: Iterable[str]) -> list[Path]:
    """Make ``folder`` look like ``root``: a symlink per entry, except the ``private`` paths (left
    for the trial to write) and the folders above them (made, and filled the same way). DVC's
    and git's files are not linked: DVC would take a linked dvc.yaml for a pipeline of its own."""
    keep = {PurePosixPath(p) for p in private}
    above = {parent for p in keep for parent in p.parents}
    links: list[Path] = []

    def mirror(source: Path, target: Path, rel: PurePosixPath) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(source.iterdir()):
            path = rel / entry.name
            if entry.name in NOT_LINKED or entry.name.endswith(".dvc") or path in keep:
                continue
            if path in above and entry.is_dir() and not entry.is_symlink():
                mirror(entry, target / entry.name, path)
            else:
                (target / entry.name).symlink_to(entry)
                links.append(target / entry.name)

    mirror(root, folder, PurePosixPath())
    return links


def unlink(folder: Path, links: Iterable[Path]) -> None:
    """Remove the symlinks :func:`overlay` made, then the folders it made that are left empty:
    the trial's own files stay."""
    made: set[Path] = set()
    for link in links:
        link.unlink(missing_ok=True)
        made.update(p for p in link.parents if p.is_relative_to(folder) and p != folder)
    for path in sorted(made, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


class Trials:
    """Runs the trials of one search, each through a stage runner of its own (its project is the
    trial's) on the profiles they share; :meth:`interrupt` stops every running one (Ctrl-C)."""

    def __init__(self, project: Project, search: Search, profiles: Profiles, run: RunRecord,
                 view: StageEvents) -> None:
        self.project, self.search, self.profiles, self.run, self.view = project, search, profiles, run, view
        self.folder = study_dir(project.root, search.study)
        self._mutex = threading.Lock()
        self._runners: dict[str, StageRunner] = {}
        self._environment: tuple[dict[str, str], dict[str, str]] | None = None  # packages, cpu: once a search

    def run_trial(self, number: int, values: Mapping[str, Any], listener: Listener | None = None) -> StageRecord:
        """Run trial ``number`` with ``values`` (dotted key -> value); its record, metrics included.
        A stage that fails makes a failed trial (its error in the record), never an exception;
        ``listener`` hears the task's ``ctx.report`` and may prune it (status ``pruned``)."""
        name = trial_name(self.search.stage, number)
        record = StageRecord(item=dict(values), started=now().isoformat(), reason=f"trial {number} of a search")
        with self._mutex:
            self.run.stages[name] = record
        began = time.monotonic()
        try:
            with self._prepared(number, values) as trial:
                record.packages, record.cpu = self._packages(trial, name)
                runner = StageRunner(trial, self.profiles, True, self.run, self.view, None)
                with self._running(name, runner), listening(listener):
                    runner(name)
                record.metrics = stage_metrics(trial.root, trial.metrics_of(name))
                objective(trial.root, self.search)  # a stage that wrote no objective failed its trial
            record.status = Outcome.SUCCEEDED.value
        except TrialPruned as exc:
            record.status, record.error = PRUNED, str(exc)
        except Exception as exc:  # noqa: BLE001 - the trial failed; the search goes on
            record.status, record.error = Outcome.FAILED.value, short_error(exc)
        except KeyboardInterrupt:  # Ctrl-C, raised in this trial's thread: the search records it
            record.status, record.error = INTERRUPTED, "interrupted"
            raise
        finally:
            record.finished, record.duration_s = now().isoformat(), round(time.monotonic() - began, 3)
        return record

    def interrupt(self) -> None:
        """Ctrl-C: raise KeyboardInterrupt in every running trial (a command's process group is killed)."""
        with self._mutex:
            runners = list(self._runners.values())
        for runner in runners:
            runner.interrupt()

    def _state(self) -> Path:
        """What a trial's folder has as its ``.conveyor``, one for the study: the stage runner's
        journal and checkpoints (a trial's own, never the project's: their paths are the trial
        folder's), its logs in the project's ``.conveyor/logs`` (``conveyor logs train@trial-3``)."""
        state = state_dir(self.folder / "state")
        logs = state / "logs"
        if not logs.is_symlink():
            (state_dir(self.project.root) / "logs").mkdir(exist_ok=True)
            logs.symlink_to(self.project.root / STATE_DIR / "logs")
        return state

    def _packages(self, trial: Project, name: str) -> tuple[dict[str, str], dict[str, str]]:
        """The stage's packages and CPU settings, found once a search (every trial runs the same code)."""
        with self._mutex:
            if self._environment is None:
                self._environment = (environment.packages(environment.code_files(trial, name)),
                                     environment.cpu_settings())
            return self._environment

    @contextmanager
    def _running(self, name: str, runner: StageRunner) -> Iterator[None]:
        with self._mutex:
            self._runners[name] = runner
        try:
            yield
        finally:
            with self._mutex:
                self._runners.pop(name, None)

    @contextmanager
    def _prepared(self, number: int, values: Mapping[str, Any]) -> Iterator[Project]:
        """The trial's project, rooted at its folder (made afresh: a trial interrupted before left
        one), with the trial's params; the folder's symlinks go when the trial ends."""
        base, stage = self.project, self.search.stage
        changes = [Override(base.params_path, key, (old := lookup(base.params, key)), as_param(value, old), key)
                   for key, value in values.items()]
        text = rendered(changes)[base.params_path]
        loaded = load_project(base.spec_path, params_text=text)
        folder = self.folder / f"trial-{number}"
        shutil.rmtree(folder, ignore_errors=True)
        params_rel = base.params_path.relative_to(base.root).as_posix()
        spec = loaded.pipeline.stages[stage]
        links = overlay(base.root, folder, [*spec.written, params_rel])
        with self._mutex:
            state = self._state()
        (folder / STATE_DIR).symlink_to(state)
        links.append(folder / STATE_DIR)
        (folder / params_rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / params_rel).write_text(text, encoding="utf-8")
        name = trial_name(stage, number)
        trial = replace(loaded, root=folder, params_path=folder / params_rel, declared=None, matrix=None,
                        pipeline=loaded.pipeline.model_copy(update={"stages": {name: spec}}),
                        graph={name: frozenset()})
        try:
            yield trial
        finally:
            unlink(folder, links)


def objective(folder: Path, search: Search) -> float:
    """The trial's objective: the number at ``key`` of its metrics file; a ValueError saying what is missing."""
    found = read_metrics(folder / search.objective.file)
    if search.objective.key not in found:
        keys = ", ".join(sorted(found)) or "none"
        raise ValueError(f"{search.objective.file} has no number '{search.objective.key}' (its numbers: {keys})")
    return found[search.objective.key]
