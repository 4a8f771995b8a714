"""When is a stage up to date? Content hashes of deps, code and outs, plus its params.

The record has the shape of DVC's ``dvc.lock`` (schema 2.0: per stage ``cmd``, ``deps``,
``params``, ``outs`` with md5 hashes), so the DVC integration can make it *be* dvc.lock.
A stage is up to date when its current inputs and outs equal what was recorded at its
last success; :func:`stale_reasons` says in words why not.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from conveyor.errors import redact
from conveyor.spec.project import Project
from conveyor.workspace import STATE_DIR, replace_atomically, state_dir

CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One path with its content hash, as a dvc.lock ``deps``/``outs`` item."""

    path: str
    md5: str
    size: int
    nfiles: int | None = None

    def to_lock(self) -> dict[str, Any]:
        item: dict[str, Any] = {"path": self.path, "hash": "md5", "md5": self.md5, "size": self.size}
        if self.nfiles is not None:
            item["nfiles"] = self.nfiles
        return item


class Hasher:
    """md5 of files and directories, remembered per (inode, mtime, size) within a process."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, int, int, int], str] = {}
        self._lock = threading.Lock()

    def file_md5(self, path: Path) -> str:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        digest = hashlib.md5()  # noqa: S324 - content fingerprint, as DVC
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                digest.update(chunk)
        with self._lock:
            self._memo[key] = digest.hexdigest()
        return digest.hexdigest()

    def entry(self, root: Path, rel: str) -> Entry | None:
        """The entry for ``rel`` under ``root``; None when it does not exist."""
        path = root / rel
        if path.is_file():
            return Entry(rel, self.file_md5(path), path.stat().st_size)
        if path.is_dir():
            return self._dir_entry(path, rel)
        return None

    def _dir_entry(self, path: Path, rel: str) -> Entry:
        files = sorted(p for p in path.rglob("*") if p.is_file())
        listing = [{"md5": self.file_md5(p), "relpath": p.relative_to(path).as_posix()} for p in files]
        listing.sort(key=lambda item: item["relpath"])
        blob = json.dumps(listing, sort_keys=True).encode()
        md5 = hashlib.md5(blob).hexdigest() + ".dir"  # noqa: S324
        return Entry(rel, md5, sum(p.stat().st_size for p in files), len(files))


@dataclass(frozen=True)
class StageState:
    """What a stage's fingerprint is made of, now or at its last success."""

    cmd: str | list[str]
    deps: tuple[Entry, ...]
    params: Mapping[str, Any]
    outs: tuple[Entry, ...]
    wdir: str | None = None

    def to_lock(self, params_file: str) -> dict[str, Any]:
        body: dict[str, Any] = {"cmd": self.cmd}
        if self.wdir:
            body["wdir"] = self.wdir
        if self.deps:
            body["deps"] = [e.to_lock() for e in self.deps]
        if self.params:
            body["params"] = {params_file: dict(self.params)}
        if self.outs:
            body["outs"] = [e.to_lock() for e in self.outs]
        return body


def stage_cmd(stage: str, project: Project) -> str | list[str]:
    """The command that runs one stage, as the record keeps it: a cmd stage's own command(s),
    ``${...}`` replaced; for a task, the ``conveyor exec`` that dvc.yaml calls."""
    spec = project.pipeline.stages[stage]
    if spec.cmd is not None:
        return spec.cmd if isinstance(spec.cmd, str) else list(spec.cmd)
    return exec_cmd(stage, project)


def exec_cmd(stage: str, project: Project) -> str:
    """``conveyor exec STAGE [-c SPEC]``: how ``dvc repro`` runs a task stage."""
    return f"conveyor exec {stage}{project.spec_option}"


def code_paths(project: Project, stage: str) -> list[str]:
    """The task's source files, relative to the root when inside it."""
    return [p.relative_to(project.root).as_posix() if p.is_relative_to(project.root) else str(p)
            for p in project.task_sources(stage)]


def data_deps(project: Project, stage: str) -> list[str]:
    """The paths a stage reads: its deps, and the outs of the stages it ``needs`` (as the compiled
    dvc.yaml lists them), so a stacked model retrains when a model it stacks changed."""
    spec = project.pipeline.stages[stage]
    needed = [out for other in spec.needs for out in project.pipeline.stages[other].written]
    return list(dict.fromkeys([*spec.deps, *needed]))


def current_state(project: Project, stage: str, hasher: Hasher) -> StageState:
    """The stage's fingerprint as the workspace is now (missing paths are left out)."""
    spec = project.pipeline.stages[stage]
    deps = current_deps(project, stage, hasher)
    outs = tuple(e for p in spec.written if (e := hasher.entry(project.root, p)) is not None)
    return StageState(stage_cmd(stage, project), deps, project.stage_params(stage), outs, spec.wdir)


def current_deps(project: Project, stage: str, hasher: Hasher) -> tuple[Entry, ...]:
    """The stage's deps (data and code) as the workspace holds them now (missing paths are left out).

    The params are not read here: a run takes them once, as the project loads, and hands the
    stage those values."""
    dep_paths = list(dict.fromkeys([*data_deps(project, stage), *code_paths(project, stage)]))
    return tuple(e for p in dep_paths if (e := _entry(project.root, p, hasher)) is not None)


def _entry(root: Path, path: str, hasher: Hasher) -> Entry | None:
    if os.path.isabs(path):
        p = Path(path)
        return Entry(path, hasher.file_md5(p), p.stat().st_size) if p.is_file() else None
    return hasher.entry(root, path)


def stale_reasons(project: Project, stage: str, state: StageState,
                  recorded: Mapping[str, Any] | None) -> list[str]:
    """Why ``stage`` must run again; an empty list means it is up to date."""
    if recorded is None:
        return ["never run"]
    spec = project.pipeline.stages[stage]
    code = set(code_paths(project, stage))
    reasons: list[str] = []
    was = {d["path"]: d.get("md5") for d in recorded.get("deps", [])}
    now = {e.path: e.md5 for e in state.deps}
    for path in dict.fromkeys([*data_deps(project, stage), *sorted(code)]):
        what = "code" if path in code else "dep"
        if path not in now:
            reasons.append(f"{what} missing: {path}")
        elif was.get(path) != now[path]:
            reasons.append(f"{what} changed: {path}")
    # a data dep it no longer has (a sweep shrunk under the stage that picks its best); a task
    # module its task stopped importing is no reason (code deps are Python sources)
    declared = set(data_deps(project, stage)) | code
    reasons += [f"dep removed: {path}" for path in was if path not in declared and not path.endswith(".py")]
    old_params: Mapping[str, Any] = next(iter(recorded.get("params", {}).values()), {})
    reasons += param_changes(old_params, dict(state.params))
    was_outs = {o["path"]: o.get("md5") for o in recorded.get("outs", [])}
    now_outs = {e.path: e.md5 for e in state.outs}
    for path in spec.written:
        if path not in now_outs:
            reasons.append(f"out missing: {path}")
        elif was_outs.get(path) != now_outs[path]:
            reasons.append(f"out changed: {path}")
    if recorded.get("cmd") != state.cmd:
        reasons.append("command changed")
    if recorded.get("wdir") != state.wdir:
        reasons.append("wdir changed")
    return reasons


def param_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``params changed: train.C 3 → 4`` for each leaf key that differs."""
    return [f"params changed: {key} {_shown(was)} → {_shown(now)}" for key, was, now in _changes(old, new, prefix)]


_UNSET = object()


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "(unset)"
    text = redact(value if isinstance(value, str) else json.dumps(value, default=str))  # before cutting: whole URLs
    return text if len(text) <= 40 else text[:37] + "..."


def _changes(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf that differs; _UNSET where absent."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        keys = list(dict.fromkeys([*new, *old]))
        return [c for k in keys for c in _changes(old.get(k, _UNSET), new.get(k, _UNSET), f"{prefix}{k}.")]
    if isinstance(old, Mapping) and new is _UNSET:
        return [c for k in old for c in _changes(old[k], _UNSET, f"{prefix}{k}.")]
    if isinstance(new, Mapping) and old is _UNSET:
        return [c for k in new for c in _changes(_UNSET, new[k], f"{prefix}{k}.")]
    return [(prefix.rstrip("."), old, new)] if old != new else []


class LockRecord:
    """The per-spec record of each stage's last success, written atomically.

    Read once, then kept in memory: stages finishing in parallel threads update it one at
    a time, and every write replaces the file whole (write to a sibling, then rename), so
    a crash never leaves it torn.
    """

    def __init__(self, path: Path, root: Path | None = None) -> None:
        self.path = path
        self.root = root  # the project whose .conveyor/ holds it: made on the first write, not on a read
        self._lock = threading.Lock()
        self._stages: dict[str, Any] | None = None

    @classmethod
    def for_project(cls, project: Project) -> LockRecord:
        rel = project.rel(project.spec_path).replace("/", "__")
        return cls(project.root / STATE_DIR / "locks" / f"{rel}.lock", project.root)

    def stages(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._read())

    def get(self, stage: str) -> Mapping[str, Any] | None:
        """The recorded entry of ``stage``, or None."""
        with self._lock:
            entry = self._read().get(stage)
            return entry if isinstance(entry, Mapping) else None

    def _read(self) -> dict[str, Any]:
        if self._stages is None:
            data = _parse(self.path.read_text(encoding="utf-8")) if self.path.exists() else None
            stages = data.get("stages", {}) if isinstance(data, dict) else {}
            self._stages = stages if isinstance(stages, dict) else {}
        return self._stages

    def save(self, stage: str, state: StageState, params_file: str) -> None:
        with self._lock:
            stages = self._read()
            stages[stage] = state.to_lock(params_file)
            self._write({"schema": "2.0", "stages": stages})

    def _write(self, data: dict[str, Any]) -> None:
        """JSON (YAML too), a stage per line: a whole rewrite per stage costs microseconds per
        entry with the C encoder, where YAML's representer took milliseconds (O(N^2) over a run)."""
        if self.root is not None:
            state_dir(self.root)  # with its .gitignore
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stages = ",\n".join(f" {json.dumps(name)}: {json.dumps(entry, default=str)}"
                             for name, entry in data["stages"].items())
        replace_atomically(self.path, f'{{"schema": {json.dumps(data["schema"])}, "stages": {{\n{stages}\n}}}}\n')


def _parse(text: str) -> Any:
    """A record as written now (JSON) or by earlier versions (YAML)."""
    try:
        return json.loads(text)
    except ValueError:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader


class Record(Protocol):
    """Where a run looks up and records each stage's last success."""

    def session(self) -> AbstractContextManager[Any]:
        """Held for a whole run (DVC's repository lock, for the DVC-backed record)."""
        ...

    def reasons(self, stage: str) -> list[str]:
        """Why ``stage`` must run again; empty when it is up to date."""
        ...

    def reload(self) -> None:
        """Under the session, after the run wrote its ``-S`` values into the params file: read
        again what was read when the session began."""
        ...

    def prepare(self, stage: str) -> None:
        """Just before ``stage`` runs: what it runs with is noted (its deps and params), and
        (DVC) a ``persist`` out linked from its cache becomes a copy."""
        ...

    def restore(self, stage: str) -> bool:
        """Bring back the outs of an earlier run with the very same inputs instead of running
        (DVC's run cache); False when there is none. Raises ``DamagedCacheError`` when what it
        brought back is not what was recorded (then removed again: the stage runs)."""
        ...

    def save(self, stage: str) -> list[str]:
        """Record that ``stage`` just succeeded: its outs as they are now, its deps and params as
        they were when it started (:meth:`prepare`). Returns what changed in between (``params
        changed: train.lr 0.1 → 0.2``, ``dep changed: data.csv``), which leaves it stale."""
        ...


class FingerprintRecord:
    """conveyor's own record (``.conveyor/locks/``), for specs that DVC does not run."""

    def __init__(self, project: Project, hasher: Hasher | None = None) -> None:
        self.project = project
        self.hasher = hasher or Hasher()
        self.lock = LockRecord.for_project(project)
        self._started: dict[str, tuple[Entry, ...]] = {}  # a running stage's deps, as it started

    def session(self) -> AbstractContextManager[Any]:
        return nullcontext(self)

    def reload(self) -> None:
        """Nothing is kept between questions: each reads the files anew."""

    def reasons(self, stage: str) -> list[str]:
        state = current_state(self.project, stage, self.hasher)
        return stale_reasons(self.project, stage, state, self.lock.get(stage))

    def prepare(self, stage: str) -> None:
        self._started[stage] = current_deps(self.project, stage, self.hasher)

    def restore(self, stage: str) -> bool:
        return False

    def save(self, stage: str) -> list[str]:
        state = current_state(self.project, stage, self.hasher)
        started = self._started.pop(stage, None)
        changed: list[str] = []
        if started is not None and started != state.deps:
            was, now = {e.path: e.md5 for e in started}, {e.path: e.md5 for e in state.deps}
            changed = [f"dep changed: {path}" for path in dict.fromkeys([*was, *now]) if was.get(path) != now.get(path)]
            state = replace(state, deps=started)  # what it ran with: stale now, as it should be
        self.lock.save(stage, state, self.project.rel(self.project.params_path))
        return changed


def plan(project: Project, selected: set[str], record: Record, *, force: bool = False) -> dict[str, list[str]]:
    """Why each selected stage would run, in order; stages that would be skipped map to ``[]``.

    A stage downstream of one that runs is due too: its deps are about to change.
    """
    reasons: dict[str, list[str]] = {}
    for stage in project.order:
        if stage not in selected:
            continue
        own = ["forced"] if force else record.reasons(stage)
        ups = [u for u in sorted(project.graph[stage]) if reasons.get(u)]
        reasons[stage] = own + ([_stale_upstream(ups)] if ups else [])
    return reasons


def _stale_upstream(names: list[str], shown: int = 3) -> str:
    """``upstream 'a' is stale``; of a matrix, the first few and how many more."""
    if len(names) == 1:
        return f"upstream '{names[0]}' is stale"
    listed = ", ".join(f"'{n}'" for n in names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"upstream {listed}{more} are stale"
