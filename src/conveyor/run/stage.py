"""Running one stage: its outs journal, a task or a command, the record update.

Prefect-free, so ``conveyor exec`` (what ``dvc repro`` calls) and the Prefect flow share it.
One mechanism for both kinds of stage: the journal (:mod:`conveyor.run.journal`) moves
the previous outs aside, the task or command writes in place, and the outs are checked
and recorded before the journal lets go of the previous ones.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Protocol

from conveyor.errors import DamagedCacheError, MissingOutputError, StageError
from conveyor.plan.fingerprint import FingerprintRecord, Hasher, Record
from conveyor.run import checkpoints, environment, resume, workers
from conveyor.run.commands import Command, CommandFailed, Sink, run_here, run_on_worker
from conveyor.run.context import StageContext, StageProgress, current_client
from conveyor.run.determinism import pinned_environ
from conveyor.run.failures import failure_detail, short_error
from conveyor.run.held import Hold, Holdings, holding
from conveyor.run.held import names as worker_names
from conveyor.run.isolated import Payload, run_isolated
from conveyor.run.journal import Entry, Journal
from conveyor.run.logs import StageLog, log_path, stage_logger
from conveyor.run.nanny_env import user_environ
from conveyor.run.needed import needed_items, stage_deps
from conveyor.run.profiles import Profiles, Resources
from conveyor.run.record import INPUTS_CHANGED, RunRecord, now
from conveyor.run.schedule import Outcome
from conveyor.run.tree_memory import CommandOverMemory
from conveyor.run.unshared import Disks, Shipment
from conveyor.run.watchdog import TaskTimedOut, TaskTimeout, Watchdog, abandoned, raise_in
from conveyor.spec.bytecode import drop_doubtful
from conveyor.spec.project import Project, ensure_importable


class StageEvents(Protocol):
    """Who hears about a stage starting and retrying, and what the user must know of it (the live view)."""

    def started(self, stage: str, profile: str, progress: StageProgress) -> None: ...

    def retrying(self, stage: str, attempt: int, error: str) -> None: ...

    def warning(self, stage: str, line: str) -> None: ...

    def notice(self, stage: str, line: str) -> None: ...


# one task module imported at a time: stages start in threads, and two threads importing NumPy (or
# any package with an import cycle) at once can each get the other's half-initialised module
# (numpy/numpy#21223, python/cpython#91238)
_IMPORTING = threading.RLock()


def load_task(project: Project, stage: str) -> Callable[[StageContext], None]:
    """Import the stage's task function (only when the stage really runs)."""
    spec = project.pipeline.stages[stage]
    ensure_importable(project.root)
    with _IMPORTING:
        fn = getattr(importlib.import_module(spec.module), spec.function)
    if not callable(fn):
        raise StageError(stage, f"{spec.task} is not callable")
    return fn  # type: ignore[no-any-return]


def check_outs(root: Path, stage: str, declared: Sequence[str]) -> None:
    """Every declared out was written; else an error naming each missing one and where it was expected."""
    missing = [rel for rel in declared if not (root / rel).exists() and not (root / rel).is_symlink()]
    if missing:
        listed = ", ".join(f"'{rel}' (expected at {root / rel})" for rel in missing)
        outs = "out" if len(missing) == 1 else "outs:"
        raise MissingOutputError(stage, f"did not write its declared {outs} {listed}")


class StageRunner:
    """Runs one attempt of one stage that is due: outs journal, the task or command, record update.

    Whether a stage is due is decided before (:mod:`conveyor.run.session`); ``force`` also
    keeps DVC's run cache from standing in for the run.
    """

    def __init__(self, project: Project, profiles: Profiles, force: bool, run: RunRecord,
                 view: StageEvents, record: Record | None, echo: Sink | None = None) -> None:
        """``record`` None: run without recording (``dvc repro`` records the stage itself).
        ``echo``: also hand every line a command writes to this sink (``conveyor exec``)."""
        self.project, self.profiles, self.force, self.run, self.view = project, profiles, force, run, view
        self.record, self.echo = record, echo
        self.journal = Journal(project.root)
        # before any profile starts: a LocalCluster's worker processes inherit sys.path, and
        # the functions a task sends them live in the project's packages
        ensure_importable(project.root)
        self._mutex = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._entries: dict[str, Entry] = {}  # the journal entry of each running stage
        self._abandoned: dict[str, BaseException] = {}  # stage -> why it was given up on
        # told when a stage is abandoned by its timeout (from the watchdog's thread): its own
        # thread is still blocked, and the stage's end will not be heard otherwise
        self.on_abandon: Callable[[str], None] | None = None
        self._holdings: dict[str, Holdings] = {}  # profile -> what this run's stages hold of its workers
        self._checkpoints: dict[str, checkpoints.Checkpoint] = {}  # the checkpoint of each running stage
        # the key of a stage's checkpoints hashes its deps: with conveyor's record, by the same memo
        self._hasher = record.hasher if isinstance(record, FingerprintRecord) else Hasher()
        self.disks = Disks(project, record)  # whether each profile's workers see the project's disk

    def __call__(self, stage: str) -> Outcome:
        spec = self.project.pipeline.stages[stage]
        record = self.run.stages[stage]
        with self._mutex:
            record.attempts += 1
            record.started = record.started or now().isoformat()
        record.profile = self.profiles.resolve(spec.on) or "local"
        code = environment.code_files(self.project, stage)
        drop_doubtful(code)  # before it is imported: Python's bytecode of an earlier version of it is not run
        if record.packages is None:  # what no fingerprint holds, for `status` to compare with the next run
            record.packages, record.cpu = environment.packages(code), environment.cpu_settings()
        placement = self.profiles.place(spec.on, [self.project.root / dep for dep in spec.deps])
        record.placement = placement.why or None
        resources = self.profiles.in_process(spec.on) if placement.in_process else self.profiles.get(spec.on)
        with self._mutex:
            given_up = self._abandoned.get(stage)
        if given_up is not None:  # a retry of a stage abandoned by its timeout: the flow has moved on
            raise given_up
        progress = StageProgress()
        self.view.started(stage, record.where, progress)
        with self._mutex:
            self._threads[stage] = threading.current_thread()
        try:
            try:
                self._attempt(stage, resources, progress, record.attempts)
            except TaskTimedOut:
                raise TaskTimeout(stage, float(spec.timeout_s or 0)) from None
            except Exception as exc:
                if type(exc).__name__ != "KilledWorker":  # distributed's, not imported here
                    raise
                raise StageError(stage, workers.died(exc, resources)) from None
        except BaseException as exc:
            record.trace = failure_detail(exc, self.project.root)
            if record.attempts <= spec.retries:
                self.view.retrying(stage, record.attempts, short_error(exc))
            raise
        finally:
            with self._mutex:  # an interrupt sent as the stage ended lands in it or nowhere, not in what follows
                self._threads.pop(stage, None)
                raise_in(threading.get_ident(), None)
        return Outcome.SUCCEEDED

    def interrupt(self) -> list[str]:
        """Raise KeyboardInterrupt inside every running stage (Ctrl-C); returns their names.

        The exception lands at the stage's next Python instruction, as Prefect's own task
        timeouts do; a task blocked inside a C call stops when that call returns. A command
        stage waits in short steps, so its process group is killed at once.
        """
        with self._mutex:
            return [stage for stage, thread in self._threads.items()
                    if thread.ident is not None and raise_in(thread.ident, KeyboardInterrupt)]

    def abandon(self, stage: str, why: BaseException | None = None) -> None:
        """Give up on a running stage that did not stop (blocked in a C call) when interrupted or
        at its timeout: put its previous outs back now; it never records a success, and the
        process does not wait for its thread. ``why``: what a retry of it raises."""
        with self._mutex:
            self._abandoned[stage] = why or KeyboardInterrupt(f"{stage} was abandoned")
            entry = self._entries.get(stage)
            thread = self._threads.get(stage)
        if thread is not None:
            abandoned(thread)
        if entry is not None:
            entry.restore()

    def abandoned(self, stage: str) -> BaseException | None:
        """Why ``stage`` was abandoned, if it was."""
        with self._mutex:
            return self._abandoned.get(stage)

    def _attempt(self, stage: str, resources: Resources, progress: StageProgress, attempt: int) -> None:
        spec = self.project.pipeline.stages[stage]
        path = log_path(self.project.root, self.run.run_id, stage)
        frozen = stage in self.project.frozen  # DVC's frozen stage: its outs are checked, never rewritten
        with StageLog(path, stage, attempt, on_line=progress.note) as log:
            placement = self.run.stages[stage].placement
            if placement:
                log.line("log", f"runs {placement}")
            if attempt > 1:
                self._free_workers(stage, resources, f"before attempt {attempt}")
            fn = self._import(stage, progress) if spec.task and not spec.deterministic else None
            with self.journal.protect(stage, () if frozen else spec.written, spec.persist) as entry:
                self._entries[stage] = entry
                if self.record is not None and not frozen:
                    self.record.prepare(stage)
                if frozen:
                    log.line("out", f"{stage} is frozen: its command does not run; its outs are checked and recorded")
                elif not self._restored(stage, log):
                    self._checkpoints[stage] = resume.checkpoint(
                        self.project, stage, self.run, self._hasher, log, self.view,
                        running=[c.path for c in list(self._checkpoints.values())])
                    began = time.monotonic()
                    with workers.WorkerWatch(stage, resources):
                        self._execute(stage, fn, resources, progress, log)
                    resume.time_saved(self.run.stages[stage], time.monotonic() - began)
                check_outs(self.project.root, stage, spec.written)
                with self._mutex:
                    too_late = self._abandoned.get(stage)
                if too_late is not None:  # it ended after all, too late: its outs went back
                    raise too_late
                if self.record is not None:
                    changed = self.record.save(stage)
                    if changed:
                        self.run.stages[stage].inputs_changed = changed
                        log.line("log", f"{INPUTS_CHANGED}: {'; '.join(changed)}")
            if not frozen:  # it succeeded: no attempt will resume what it saved
                checkpoints.drop(self.project.root, stage)

    def _execute(self, stage: str, fn: Callable[[StageContext], None] | None, resources: Resources,
                 progress: StageProgress, log: StageLog) -> None:
        """Run the stage's command or task (``fn``: the task function; None for a deterministic task);
        where its workers do not see the project, in a scratch directory on one of them."""
        say = partial(log.line, "log")
        shipment = self.disks.shipment(stage, resources, say, self._checkpoints.get(stage))
        with self._holding(stage, resources, progress) as hold:
            if self.project.pipeline.stages[stage].task is None:
                self._command(stage, resources, log, hold, shipment)
            elif fn is None:  # deterministic: its libraries must load with the pins, in a process of its own
                self._isolated(stage, resources, progress, log)
            elif shipment is not None:
                self._call_away(fn, stage, resources, log, hold, shipment)
            else:
                self._call(fn, stage, resources, progress, stage_logger(stage), hold)

    @contextmanager
    def _holding(self, stage: str, resources: Resources, progress: StageProgress) -> Iterator[Hold | None]:
        """The workers the stage holds for its ``resources:`` while it runs (:mod:`conveyor.run.held`)."""
        spec = self.project.pipeline.stages[stage]
        if not spec.resources or resources.client is None:
            if spec.resources:  # a profile swapped for one without workers (--profile gpu=local)
                stage_logger(stage).warning("resources %s not held: profile '%s' has no Dask workers",
                                            spec.resources, resources.profile)
            yield None
            return
        with self._mutex:
            holdings = self._holdings.setdefault(resources.profile, Holdings(resources.client, resources.profile))
        progress.description = "waiting for " + ", ".join(f"{k}={v:g}" for k, v in spec.resources.items())
        with holding(holdings, stage, spec.resources, one_worker=spec.task is None) as hold:
            progress.description = ""
            assert hold is not None
            held = {"workers": worker_names(resources.client, hold.workers), "from": now().isoformat()}
            self.run.stages[stage].held = held
            try:
                yield hold
            finally:
                held["until"] = now().isoformat()

    def _restored(self, stage: str, log: StageLog) -> bool:
        """Whether DVC's run cache stood in for the run; False (the stage runs) when it has
        nothing for these inputs, or when what it brought back was damaged (the user is told)."""
        if self.record is None or self.force:
            return False
        try:
            restored = self.record.restore(stage)
        except DamagedCacheError as exc:
            log.line("out", str(exc))
            self.run.stages[stage].reason += f"; {exc.reason}"
            self.view.warning(stage, str(exc))
            return False
        if restored:
            log.line("out", "restored from DVC's run cache: it ran before with these deps, params and command")
            self.run.stages[stage].reason += "; restored from DVC's run cache"
        return restored

    def _import(self, stage: str, progress: StageProgress) -> Callable[[StageContext], None]:
        """The task function; the live view says what is importing (torch alone takes seconds)."""
        progress.description = f"importing {self.project.pipeline.stages[stage].module}"
        fn = load_task(self.project, stage)
        progress.description = ""
        return fn

    def _call(self, fn: Callable[[StageContext], None], stage: str, resources: Resources,
              progress: StageProgress, logger: logging.Logger, hold: Hold | None) -> None:
        root, spec = self.project.root, self.project.pipeline.stages[stage]
        ctx = StageContext(
            stage=stage, params=self.project.stage_params(stage),
            deps=stage_deps(self.project, stage), outs={o: root / o for o in spec.outs},
            metrics={m: root / m for m in spec.metrics}, names=spec.names, root=root, log=logger,
            item=self.project.item_of(stage), needed=needed_items(self.project, stage),
            client=resources.client, executor=resources.executor,
            n_workers=len(hold.workers) if hold is not None else resources.n_workers,
            devices=resources.devices, progress=progress, checkpoint_dir=self._checkpoints[stage].path)
        timeout = spec.timeout_s

        def give_up() -> None:  # still blocked past the timeout: the flow hears it now
            self.abandon(stage, TaskTimeout(stage, float(timeout or 0), abandoned=True))
            if self.on_abandon is not None:
                self.on_abandon(stage)

        try:
            with current_client(resources.client) if resources.client is not None else nullcontext(), \
                    checkpoints.using(self._checkpoints[stage]), \
                    Watchdog(timeout, give_up) if timeout else nullcontext():
                if resources.client is not None:
                    self._ship_code()
                fn(ctx)
        except TaskTimedOut:
            if self.run.stages[stage].attempts > spec.retries:  # no retry will: free them for the stages after
                self._free_workers(stage, resources, "after its timeout")
            raise

    def _free_workers(self, stage: str, resources: Resources, when: str) -> None:
        """Restart the stage's workers (:func:`conveyor.run.workers.restart`) unless another stage uses them."""
        with self._mutex:
            others = sorted(s for s in self._threads if s != stage and self.run.stages[s].profile == resources.profile)
        workers.restart(resources, stage_logger(stage), when, others)

    def _ship_code(self) -> None:
        """What the task sends the workers carries the project's code: they need none (:mod:`conveyor.run.shipping`)."""
        from conveyor.run.shipping import ship_project_code

        ship_project_code(self.project.root)

    def _isolated(self, stage: str, resources: Resources, progress: StageProgress, log: StageLog) -> None:
        """A deterministic task: run in a child process started with the pinned environment."""
        spec = self.project.pipeline.stages[stage]
        if resources.client is not None or spec.task is None:
            raise StageError(stage, f"deterministic: true runs a task in a process of its own, without the "
                             f"Dask workers of profile '{resources.profile}': run it without 'on:'")
        run_isolated(self._payload(stage, resources), env=self._environ(stage), timeout_s=spec.timeout_s,
                     progress=progress, sink=self._sink(log))

    def _call_away(self, fn: Callable[[StageContext], None], stage: str, resources: Resources, log: StageLog,
                   hold: Hold | None, shipment: Shipment) -> None:
        """A task on a worker that does not see the project (:mod:`conveyor.run.scratch_task`)."""
        from conveyor.run.scratch_task import run_task_on_worker

        assert resources.client is not None
        self._ship_code()
        outs = run_task_on_worker(resources.client, fn, self._payload(stage, resources), shipment, self._sink(log),
                                  hold.workers if hold else None)
        self.disks.receive(shipment, outs, lambda line: log.line("log", line))

    def _payload(self, stage: str, resources: Resources) -> Payload:
        """The picklable part of the task's StageContext."""
        root, spec = self.project.root, self.project.pipeline.stages[stage]
        return Payload(
            task=spec.task or "", stage=stage, root=str(root), params=dict(self.project.stage_params(stage)),
            deps={d: str(p) for d, p in stage_deps(self.project, stage).items()},
            outs={o: str(root / o) for o in spec.outs}, metrics={m: str(root / m) for m in spec.metrics},
            names=dict(spec.names), item=self.project.item_of(stage), needed=needed_items(self.project, stage),
            threads=resources.n_workers if resources.executor is not None else 0,
        )

    def _environ(self, stage: str) -> dict[str, str]:
        """What a stage's process gets over the runner's environment (a command's, or an isolated task's)."""
        env = {"CONVEYOR_STAGE": stage, "CONVEYOR_RUN_ID": self.run.run_id}
        if stage in self._checkpoints:
            env[checkpoints.ENV_DIR] = str(self._checkpoints[stage].path)
        if self.project.pipeline.stages[stage].deterministic:
            pins = pinned_environ(user_environ())
            self.run.stages[stage].deterministic = pins
            env |= pins
        return env

    def _sink(self, log: StageLog) -> Sink:
        def sink(stream: str, line: str) -> None:
            log.line(stream, line)  # the live view shows the latest line
            if self.echo is not None:
                self.echo(stream, line)

        return sink

    def _command(self, stage: str, resources: Resources, log: StageLog, hold: Hold | None,
                 shipment: Shipment | None) -> None:
        spec = self.project.pipeline.stages[stage]
        env = self._environ(stage)
        shell: tuple[str, ...] = ("/bin/sh", "-c")
        if self.project.dvc is not None:  # as `dvc repro` runs it: the user's shell, DVC's variables
            env |= {"DVC_ROOT": str(self.project.root), "DVC_STAGE": stage}
            shell = self.project.dvc.shell
        command = Command(stage, spec.commands, cwd=str(self.project.root / (spec.wdir or "")), env=env,
                          timeout_s=spec.timeout_s, own_gpu=bool(resources.devices), shell=shell)
        sink = self._sink(log)
        if resources.client is not None:
            try:
                finished = run_on_worker(resources.client, command, sink, hold.workers if hold else None,
                                         spec.resources, shipment)
            except CommandOverMemory as exc:  # in the words a task past memory_limit gets
                raise StageError(stage, workers.over_memory(exc, resources)) from None
        else:
            finished = run_here(command, sink)
        if finished.returncode != 0:
            raise CommandFailed(stage, finished.returncode, finished.stderr_tail)
        if shipment is not None:
            self.disks.receive(shipment, finished.outs, lambda line: log.line("log", line))

