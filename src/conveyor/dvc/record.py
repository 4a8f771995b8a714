"""DVC's own ``dvc.lock`` as conveyor's record: for a dvc.yaml run as it is, and for the
spec a dvc.yaml is compiled from.

``conveyor run`` and ``dvc repro`` are the same pipeline with one fingerprint: DVC decides
whether a stage changed, and after a stage succeeds under ``conveyor run`` it is recorded
through DVC's own stage object, as ``dvc repro`` records it (hashes and lock entry into
dvc.lock, outs into the DVC cache), so after either tool the other has nothing to do.
DVC is imported only here, lazily.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.dvc.compile import compiled_from, drift, dvc_yaml, rendered, write_dvc_yaml
from conveyor.dvc.inputs import as_started, command_changes, recorded_cmd, started_inputs
from conveyor.dvc.lockfile import LockWriter
from conveyor.dvc.missing import changed_with_data, pull_missing_deps, pull_run_cache, pulled_instead
from conveyor.dvc.reasons import params_changed, reason, rel_to, stage_status
from conveyor.dvc.restore import checkout_recorded, damage, set_aside
from conveyor.dvc.rwlock import kept_from_forks_of_the_run, running_dvc
from conveyor.dvc.stamps import Stamps
from conveyor.dvc.vouched import outs_match
from conveyor.errors import UNWRITABLE, RunLockedError, UnwritableError, UsageError
from conveyor.plan.fingerprint import FingerprintRecord, Record, code_paths
from conveyor.spec.project import Project

if TYPE_CHECKING:
    from dvc.stage import PipelineStage



class DvcRecord:
    """DVC's dvc.lock and cache as conveyor's record: for a dvc.yaml conveyor runs as it is
    (SPEC.md §2.3), and for the spec a dvc.yaml is compiled from.

    Each stage is DVC's own stage object, loaded once per run: DVC decides whether it
    changed (``Stage.status``, what ``dvc status`` prints) and records a success the way
    ``dvc repro`` does (``save``: hashes and the run cache; ``commit``: outs into the
    cache and .gitignore; ``dump``: the stage's entry in dvc.lock, by DVC's lock writer).
    DVC's repository lock is held for the whole run, so a concurrent ``dvc repro`` (or
    another conveyor run) fails at once instead of racing on dvc.lock; stages finishing
    at once are recorded one at a time (DVC's repo object is not thread-safe).
    """

    def __init__(self, project: Project, *, question: bool = False, no_commit: bool = False,
                 allow_missing: bool = False, no_run_cache: bool = False, pull: bool = False) -> None:
        """``question``: for ``status`` and ``run --dry-run``, which write nothing (not even a
        dvc.yaml that is out of date: they read it as a run would compile it). ``no_commit``,
        ``allow_missing``, ``no_run_cache`` and ``pull``: as ``dvc repro``'s flags of those names."""
        from dvc.repo import Repo
        from dvc.scm import SCMError

        for name in ("dvc", "dvc_objects", "dvc_data"):  # DVC prints its records itself, as `dvc repro` does;
            logging.getLogger(name).propagate = False     # passed on to the root logger, each line came twice
        self.project = project
        self.question = question
        self.no_commit = no_commit
        self.allow_missing = allow_missing
        self.no_run_cache = no_run_cache
        self.pull = pull
        self.file = project.dvc.file if project.dvc is not None else dvc_yaml(project)
        self._loaded = project.dvc.loaded if project.dvc is not None else None  # as loading the project read them
        handed = self._loaded.take() if self._loaded is not None else None
        if handed is not None:
            self.repo = handed
        else:
            self._loaded = None
            try:
                self.repo = Repo(str(project.root))
            except SCMError as exc:  # .dvc/ without git around it
                raise UsageError(f"{exc}: DVC keeps dvc.lock beside git; run `git init` there (or "
                                 "`dvc config core.no_scm true` to use DVC without git)") from None
        self._mutex = threading.RLock()
        self._code = {name: set(code_paths(project, name)) for name in project.order}
        self._stages_read: dict[str, PipelineStage] = {}
        self._locked_read: set[str] = set()
        self._entries_read: dict[str, Any] = {}  # dvc.lock's entry of each stage, as the session read it or wrote it
        self._stamps = Stamps(project)  # DVC's past answers, where nothing they were decided on changed
        self._deferred = False  # DVC's stages not read yet: the stamps may answer for every stage
        self._started: dict[str, dict[str, tuple[Any, Any]]] = {}  # a running stage's deps: (hash, meta) by path
        # one writer per dvc.lock: a stage of another dvc.yaml (upstream of this one's) is recorded beside it
        others = [file for file, _ in project.dvc.addresses.values()] if project.dvc is not None else []
        self._locks = {path.with_suffix(".lock"): LockWriter(path.with_suffix(".lock"), project.root,
                                                             self.repo.scm_context.track_file)
                       for path in dict.fromkeys([self.file, *others])}

    @contextmanager
    def session(self) -> Iterator[DvcRecord]:
        """Hold DVC's repository lock (and keep the repo open) for a whole run."""
        from dvc.lock import LockError
        from dvc.repo import lock_repo

        held = ExitStack()  # the lock, held across the run; the mutex only guards taking it
        try:
            with self._mutex:
                held.enter_context(lock_repo(self.repo))
        except OSError as exc:  # a read-only checkout, a full disk: DVC cannot write .dvc/tmp/lock
            self.repo.close()
            if exc.errno not in UNWRITABLE:
                raise
            raise UnwritableError.of(exc) from exc
        except LockError as exc:
            self.repo.close()
            raise RunLockedError(f"another DVC or conveyor process holds {self.project.root / '.dvc/tmp/lock'}:"
                                 " wait for it to finish (dvc repro, dvc exp run, conveyor run), then run again"
                                 ) from exc
        held.enter_context(kept_from_forks_of_the_run(self.repo))
        busy = running_dvc(self.project.root)
        if busy:
            with self._mutex:
                held.close()
                self.repo.close()
            raise RunLockedError(f"DVC is running in {self.project.root} ({'; '.join(busy)}): wait for it to "
                                 "finish, then run again")
        try:
            if self.question:
                with self._mutex:
                    self._load(as_compiled=self.project.dvc is None)
            else:
                with self._mutex:  # what a killed run recorded only in the pending log, before dvc.lock is read
                    for path, writer in self._locks.items():
                        writer.merge_pending(partial(self._outs_match, path.with_suffix(".yaml")))
                    if self.pull:
                        pull_run_cache(self.repo)
                self.reload()
            yield self
        finally:
            with self._mutex:
                try:
                    for writer in self._locks.values():
                        writer.flush()  # what stages recorded since the last write, before DVC's lock goes
                    self._stamps.close()
                finally:
                    held.close()
                    self.repo.close()

    def reload(self) -> None:
        """Under the session: compile dvc.yaml again where it is conveyor's and no longer matches
        the spec and its params (a sweep grown in params.yaml, a stage added to the spec), then
        read DVC's stages from it; called again after ``-S`` wrote the params file."""
        with self._mutex:
            if self.project.dvc is None and drift(self.project) is not None:
                write_dvc_yaml(self.project)
            self._load()

    @contextmanager
    def unlocked(self) -> Iterator[DvcRecord]:
        """The record as it stands, without DVC's lock: for a question asked while someone holds the
        lock (a run) or where no one can take it (a read-only checkout), or that writes nothing
        (``status``, ``run --dry-run``). Never for a run. A dvc.yaml that no longer matches the
        spec is read as a run would compile it again, and not written."""
        self._stamps.usable = False  # what a run changes meanwhile is DVC's to say
        try:
            with self._mutex:
                self._load(as_compiled=self.project.dvc is None)
            yield self
        finally:
            with self._mutex:
                self.repo.close()

    def _load(self, *, as_compiled: bool = False, defer: bool = True) -> None:
        """DVC's stages and dvc.lock's entries; ``as_compiled``: the stages of the dvc.yaml the spec
        compiles to now, whatever the file holds (for a question, which writes nothing); ``defer``:
        not read until a stage needs them when DVC's past answers may answer for every stage
        (:mod:`conveyor.dvc.stamps`)."""
        from dvc.dvcfile import load_file

        from conveyor.spec.dvcload import SchemaChecked

        current = self._loaded.current() if self._loaded is not None else None  # under DVC's lock: still current?
        self._loaded = None
        answers = self._stamps.open()  # (and the bytes of what they were decided on, as the session began)
        self._deferred = defer and current is None and not as_compiled and answers
        if self._deferred:
            return
        if current is not None:
            self._stages_read, self._locked_read = dict(current[0]), set(current[1])
        else:
            dvcfile = load_file(self.repo, str(self.file))  # absolute: DVC reads a relative path from the cwd
            checked = SchemaChecked(self.project.root, self.file)
            if as_compiled and drift(self.project) is not None:  # DVC's own schema check, on the text not written
                dvcfile.__dict__["contents"] = dvcfile.validate(rendered(self.project), str(self.file))
            elif checked.before:
                dvcfile.SCHEMA = None  # these very bytes passed DVC's schema check (it only checks)
            self._stages_read = {stage.name: stage for stage in dvcfile.stages.values()}
            self._entries_read = dict(dvcfile.lockfile_contents.get("stages", {}))
            self._locked_read = set(self._entries_read)
        self._load_others()

    def _read_now(self) -> None:
        """DVC's stages, read where the stamps left them unread (a stage they do not answer for)."""
        if self._deferred:
            self._load(defer=False)

    @property
    def _stages(self) -> dict[str, PipelineStage]:
        self._read_now()
        return self._stages_read

    @property
    def _locked(self) -> set[str]:
        self._read_now()
        return self._locked_read

    @property
    def _entries(self) -> dict[str, Any]:
        self._read_now()
        return self._entries_read

    def _load_others(self) -> None:
        """The stages of other dvc.yaml files that run with this one (upstream of its stages), and
        their entries in their own dvc.lock, by the name conveyor gives them (``sub/dvc.yaml:make``)."""
        from dvc.dvcfile import load_file

        addresses = self.project.dvc.addresses if self.project.dvc is not None else {}
        for path in dict.fromkeys(file for file, _ in addresses.values()):
            dvcfile = load_file(self.repo, str(path))
            entries = dict(dvcfile.lockfile_contents.get("stages", {}))
            by_name = {stage.name: stage for stage in dvcfile.stages.values()}
            for name, (file, own) in addresses.items():
                if file == path and own in by_name:
                    self._stages[name] = by_name[own]
                    if own in entries:
                        self._entries[name] = entries[own]
                        self._locked.add(name)

    def _outs_match(self, dvc_file: Path, own: str, entry: Mapping[str, Any]) -> bool:
        """:func:`outs_match` for an entry of the dvc.lock beside ``dvc_file``, named as it names it."""
        source = self.project.dvc
        named = {(f, n): name for name, (f, n) in source.addresses.items()} if source is not None else {}
        return outs_match(self.project, named.get((dvc_file, own), own), entry)

    def _stage(self, name: str) -> PipelineStage:
        if name not in self._stages:  # an item new in the params file after the dvc.yaml read (dry-run -S)
            raise UsageError(f"stage '{name}' is not in {self.project.rel(self.file)} as DVC reads it: "
                             "run `conveyor compile`, then run again")
        return self._stages[name]

    def recorded(self, stage: str) -> bool:
        """True when dvc.lock has an entry for ``stage`` (read once per session, kept as stages succeed)."""
        return stage in self._locked

    def reasons(self, stage: str) -> list[str]:
        """Why DVC considers ``stage`` changed; empty when ``dvc status`` has nothing to say."""
        from dvc.exceptions import DvcException

        with self._mutex:
            if self._stamps.up_to_date(stage):
                return []
            if not self.recorded(stage) and not getattr(self._stages.get(stage), "frozen", False):
                return ["never run"]  # (a new item of a sweep grown by -S is not in the file DVC read)
            st = self._stage(stage)  # DVC asks a frozen stage only about its outs, recorded or not
            try:
                if self.allow_missing and not changed_with_data(st, self._upstream(stage)):
                    return []
                if self.pull and not self.question and not changed_with_data(st, self._upstream(stage)) \
                        and stage_status(st) and pulled_instead(st):
                    return []
                before = self._stamps.before(st)
                status = stage_status(st)
            except (OSError, DvcException) as exc:  # e.g. a symlinked out whose cache is gone
                return [f"DVC cannot check it: {exc}"]
            entries = [e for e in status.get(st.addressing, []) if not (st.frozen and e == "always changed")]
            paths = {str(item): item.fs_path for item in [*st.deps, *st.outs]}
            reasons = [r for entry in entries
                       for r in reason(entry, self._code[stage], partial(params_changed, st), self.project.root, paths)]
            reasons += self._removed_deps(stage, st)
            if "changed command" in entries:  # only because a ${param} in it changed? say which
                recorded = recorded_cmd(self._file_of(stage).with_suffix(".lock"), self._own(stage))
                explained = command_changes(st, recorded)
                if explained is not None:
                    at = reasons.index("command changed")
                    reasons[at:at + 1] = [r for r in explained if r not in reasons]
            self._stamps.after(stage, st, before, up_to_date=not reasons)
            return reasons

    def _upstream(self, stage: str) -> list[PipelineStage]:
        return [self._stages[name] for name in self.project.graph[stage] if name in self._stages]

    def _removed_deps(self, stage: str, st: PipelineStage) -> list[str]:
        """``dep removed: models/m-0.1.json`` for each data dep dvc.lock records and the stage no
        longer has: a sweep shrunk under the stage that picks its best. DVC does not say it (its
        status checks the deps the stage has); the stage's output still reflects the dropped one."""
        recorded = self._entries.get(stage) or {}
        now = {dep.def_path for dep in st.deps}
        wdir = os.path.relpath(st.wdir, self.project.root) if st.wdir else ""
        gone = [os.path.normpath(os.path.join(wdir, str(d.get("path")))) for d in recorded.get("deps", [])
                if isinstance(d, Mapping) and d.get("path") not in now]
        return [f"dep removed: {path}" for path in gone if path not in self._code[stage]]

    def commit_sources(self, stages: Iterable[str], *, force: bool = False) -> list[str]:
        """The ``.dvc`` files upstream of ``stages`` whose data changed, committed as ``dvc repro``
        commits them before the first stage (:mod:`conveyor.dvc.sources`); returns those written."""
        from conveyor.dvc.sources import commit_sources, sources_of

        with self._mutex:
            return commit_sources(self.project, self.repo, sources_of(self.project, stages), force=force,
                                  no_commit=self.no_commit, allow_missing=self.allow_missing, pull=self.pull)

    def prepare(self, stage: str) -> None:
        """What ``dvc repro`` does to a stage's outs before its command (a ``persist`` out linked
        from the cache is made a copy, so the command cannot change the cache through it), and
        what DVC does not: the stage's deps and params as it starts, to record those."""
        with self._mutex:
            st = self._stage(stage)
            for out in st.outs:
                if out.persist and out.exists:
                    out.unprotect()
            self._started[stage] = started_inputs(st)

    def restore(self, stage: str) -> bool:
        """Check the stage's outs out of DVC's run cache when it ran before with these very deps,
        params and command (as ``dvc repro`` does instead of running it); False when it did not.

        Raises :class:`DamagedCacheError` (the restored outs removed again) when what came out of
        the cache does not hash to what DVC recorded for it (:mod:`conveyor.dvc.restore`)."""
        from dvc.exceptions import DvcException
        from dvc.stage.cache import RunCacheNotFoundError

        with self._mutex:
            st = self._stage(stage)
            if self._removed_deps(stage, st):  # DVC would check dvc.lock's outs out: made with those deps
                return False
            try:
                if self.pull:
                    pull_missing_deps(st)  # as dvc repro --pull does before it looks for a run
                cached = checkout_recorded(st, run_cache=not self.no_run_cache, pull=self.pull)
            except RunCacheNotFoundError:
                return False
            except DvcException:  # a damaged cache entry: run the command instead
                return False
            found = damage(cached)
            if found is not None:
                raise set_aside(stage, cached, found, rel=lambda path: rel_to(self.project.root, path))
        return True

    def save(self, stage: str) -> list[str]:
        """Record a success as ``dvc repro`` does (hashes and the run cache, unless an out is
        uncached; outs into the DVC cache; the stage's entry in dvc.lock), with one difference:
        deps and params that changed while the stage ran are recorded as they were when it
        started, not as DVC reads them afterwards (dvc#11058), so the stage is stale, and no
        run cache entry claims its outs came from the new values. Returns those changes."""
        with self._mutex:
            st = self._stage(stage)
            uncached = any(not o.use_cache for o in st.outs if not (o.is_metric or o.is_plot))
            st.save(run_cache=False)
            changed = as_started(st, self._started.pop(stage, {}))
            if changed:
                st.md5 = st.compute_md5()
            elif not (uncached or self.no_commit):
                st.repo.stage_cache.save(st)
            if not self.no_commit:  # `dvc commit` puts the outs into the cache later
                st.commit()
            self._dump_lock(stage, st)
            self._locked.add(stage)
            self._stamps.ran(stage)
        return changed

    def _file_of(self, stage: str) -> Path:
        """The dvc.yaml declaring ``stage``: dvc.lock beside it records it."""
        return self.project.dvc.file_of(stage) if self.project.dvc is not None else self.file

    def _own(self, stage: str) -> str:
        """``stage`` as its dvc.lock names it."""
        return self.project.dvc.name_in_file(stage) if self.project.dvc is not None else stage

    def _dump_lock(self, stage: str, st: PipelineStage) -> None:
        """The stage's entry as DVC's ``Lockfile.dump_stages`` makes it (its serializer, its
        round-trip YAML), into dvc.lock in batches (:mod:`conveyor.dvc.lockfile`): whole, through a
        temporary file renamed over it, and the entry in the pending log until then."""
        from dvc.stage.serialize import to_lockfile

        entry = to_lockfile(st)[st.name]
        self._entries[stage] = entry
        self._locks[self._file_of(stage).with_suffix(".lock")].update(st.name, entry)


def open_record(project: Project, *, question: bool = False, no_commit: bool = False,
                allow_missing: bool = False, no_run_cache: bool = False, pull: bool = False) -> Record:
    """DVC's record for a dvc.yaml and for the spec dvc.yaml is compiled from (in a DVC repo),
    else conveyor's own. ``question``: a record that writes nothing (:class:`DvcRecord`);
    ``no_commit``, ``allow_missing``, ``pull``: ``dvc repro``'s flags, for DVC's record only (a
    UsageError with conveyor's own); ``no_run_cache``: conveyor's own record has no run cache."""
    if project.dvc is not None or compiled_from(project):  # compiled again under the run's locks where stale
        return DvcRecord(project, question=question, no_commit=no_commit, allow_missing=allow_missing,
                         no_run_cache=no_run_cache, pull=pull)
    for flag, given in (("--no-commit", no_commit), ("--allow-missing", allow_missing), ("--pull", pull)):
        if given:
            raise UsageError(f"{flag} is a flag of DVC's record (dvc.lock and its cache), which "
                             f"{project.rel(project.spec_path)} does not use: run without it, or "
                             "compile the spec for DVC (`dvc init`, then `conveyor compile`)")
    return FingerprintRecord(project)
