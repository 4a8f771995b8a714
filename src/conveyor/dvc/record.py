"""DVC's own ``dvc.lock`` as conveyor's record, for the spec ``dvc.yaml`` is compiled from.

``conveyor run`` and ``dvc repro`` are the same pipeline with one fingerprint: after a
stage succeeds under ``conveyor run`` it is committed through DVC's API (hashes into
dvc.lock, outs into the DVC cache), so after either tool the other has nothing to do.
DVC is imported only here, lazily.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import yaml

from conveyor.dvc.compile import compiled_from, drift
from conveyor.errors import RunLockedError, UsageError
from conveyor.plan.fingerprint import FingerprintRecord, Record, code_paths, param_changes
from conveyor.spec.project import Project, lookup


def _reason(stage: str, entry: Any, code: set[str], project: Project, locked: Mapping[str, Any]) -> list[str]:
    """DVC's status entry for a stage, in conveyor's words."""
    if isinstance(entry, str):
        return {"changed checksum": ["command or definition changed"], "changed command": ["command changed"],
                "always changed": ["always changed"]}.get(entry, [entry])
    reasons: list[str] = []
    for kind, changes in entry.items():
        if kind == "changed deps":
            for path, state in changes.items():
                if isinstance(state, dict):  # a params file: {key: "modified" | "new" | "deleted"}
                    reasons += _param_reasons(project, stage, state, locked)
                else:
                    what = "code" if path in code else "dep"
                    reasons.append(f"{what} {'missing' if state == 'deleted' else 'changed'}: {path}")
        elif kind == "changed outs":
            reasons += [_out_reason(project, path, state) for path, state in changes.items()]
    return reasons


def _out_reason(project: Project, path: str, state: str) -> str:
    """An out DVC calls changed, in plain words (a fresh clone's outs are 'missing', not 'not in cache')."""
    if state == "deleted" or not (project.root / path).exists():
        return f"out missing: {path}"
    if state == "not in cache":
        return f"out not in the DVC cache: {path}"
    return f"out changed: {path}"


def _param_reasons(project: Project, stage: str, state: Mapping[str, str], locked: Mapping[str, Any]) -> list[str]:
    """Leaf keys that changed (``params changed: train.xgb.booster.max_depth``)."""
    old: Mapping[str, Any] = next(iter(locked.get(stage, {}).get("params", {}).values()), {})
    reasons: list[str] = []
    for key in state:
        try:
            new = lookup(project.params, key)
        except KeyError:
            new = None
        reasons += param_changes(old.get(key), new, f"{key}.") or [f"params changed: {key}"]
    return reasons


class DvcRecord:
    """DVC's dvc.lock and cache as conveyor's record (the spec dvc.yaml is compiled from).

    One DVC ``Repo`` per run; its lock is held for the whole run, so a concurrent
    ``dvc repro`` (or another conveyor run) fails at once instead of racing on dvc.lock.
    DVC's repo object is not thread-safe: every call goes through one mutex.
    """

    def __init__(self, project: Project) -> None:
        from dvc.repo import Repo

        self.project = project
        self.repo = Repo(str(project.root))
        self._mutex = threading.RLock()
        self._code = {name: set(code_paths(project, name)) for name in project.order}

    @contextmanager
    def session(self) -> Iterator[DvcRecord]:
        """Hold DVC's repository lock (and keep the repo open) for a whole run."""
        from dvc.lock import LockError
        from dvc.repo import lock_repo

        held = ExitStack()  # the lock, held across the run; the mutex only guards taking it
        try:
            with self._mutex:
                held.enter_context(lock_repo(self.repo))
        except LockError as exc:
            self.repo.close()
            raise RunLockedError(f"another DVC or conveyor process holds {self.project.root / '.dvc/tmp/lock'}:"
                                 " wait for it to finish (dvc repro, dvc exp run, conveyor run), then run again"
                                 ) from exc
        busy = self._running_dvc()
        if busy:
            with self._mutex:
                held.close()
                self.repo.close()
            raise RunLockedError(f"DVC is running in {self.project.root} ({'; '.join(busy)}): wait for it to "
                                 "finish, then run again")
        try:
            yield self
        finally:
            with self._mutex:
                held.close()
                self.repo.close()

    def _running_dvc(self) -> list[str]:
        """Live DVC commands holding path locks (``dvc repro`` releases its repository lock while
        a stage command runs and keeps only these), as ``"dvc repro (pid 123)"``."""
        path = self.project.root / ".dvc" / "tmp" / "rwlock"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        holders = [*data.get("write", {}).values(), *(i for infos in data.get("read", {}).values() for i in infos)]
        return sorted({f"{h.get('cmd', 'dvc')} (pid {h['pid']})" for h in holders
                       if isinstance(h, dict) and _alive(int(h.get("pid", 0)))})

    def locked_stages(self) -> dict[str, Any]:
        path = self.project.root / "dvc.lock"
        if not path.exists():
            return {}
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        stages = data.get("stages", {})
        return stages if isinstance(stages, dict) else {}

    def reasons(self, stage: str) -> list[str]:
        """Why DVC considers ``stage`` changed; empty when ``dvc status`` has nothing to say."""
        from dvc.exceptions import DvcException

        with self._mutex:
            locked = self.locked_stages()
            if stage not in locked:
                return ["never run"]
            try:
                status = self.repo.status(targets=[stage])
            except (OSError, DvcException) as exc:  # e.g. a symlinked out whose cache is gone
                return [f"DVC cannot check it: {exc}"]
        reasons: list[str] = []
        for entry in status.get(stage, []):
            reasons += _reason(stage, entry, self._code[stage], self.project, locked)
        return reasons

    def save(self, stage: str) -> None:
        """Record a success: hashes into dvc.lock, outs into the DVC cache (``dvc commit -f``)."""
        with self._mutex:
            self.repo.commit(stage, force=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_compiled(project: Project) -> None:
    """Refuse to run a DVC pipeline whose dvc.yaml no longer matches its spec."""
    if drift(project) is not None:
        raise UsageError(f"dvc.yaml is out of date with {project.rel(project.spec_path)}: "
                         "run `conveyor compile` (and commit it), then run again")


def up_to_date_in_own_record(project: Project) -> list[str]:
    """Stages conveyor's own record (``.conveyor/locks``) calls up to date, in run order.

    Empty once dvc.yaml is compiled from the spec: DVC's record is the one in use then.
    """
    if compiled_from(project):
        return []
    from conveyor.plan.fingerprint import plan

    reasons = plan(project, set(project.order), FingerprintRecord(project))
    return [stage for stage in project.order if not reasons[stage]]


def carry_into_dvc_lock(project: Project, stages: list[str]) -> list[str]:
    """Record ``stages`` in dvc.lock and the DVC cache as they are (``dvc commit``), so adding
    DVC to a project does not rerun what already ran. Returns the stages recorded."""
    if not stages or not compiled_from(project):
        return []
    record = DvcRecord(project)
    with record.session():
        fresh = [stage for stage in stages if stage not in record.locked_stages()]
        for stage in fresh:
            record.save(stage)
    return fresh


def open_record(project: Project) -> Record:
    """DVC's record for the spec dvc.yaml is compiled from (in a DVC repo), else conveyor's own."""
    if compiled_from(project):
        check_compiled(project)
        return DvcRecord(project)
    return FingerprintRecord(project)
