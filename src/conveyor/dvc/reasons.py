"""DVC's status of a stage, in conveyor's words: ``dep changed: data.csv``, ``params changed:
train.lr 0.1 → 0.2``, ``out missing: model.pt`` (paths relative to the project root)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.plan.fingerprint import param_changes

if TYPE_CHECKING:
    from dvc.stage import PipelineStage


def reason(entry: Any, code: set[str], params: Callable[[str, Mapping[str, str]], list[str]], root: Path,
            paths: Mapping[str, str]) -> list[str]:
    """DVC's status entry for a stage, in conveyor's words (paths relative to the project root).

    ``paths``: the absolute path of each dep and out by the name DVC's status gives it (relative
    to the working directory when it lies below it, else as dvc.yaml writes it)."""
    if isinstance(entry, str):
        return {"changed checksum": ["command or definition changed"], "changed command": ["command changed"],
                "always changed": ["always changed"]}.get(entry, [entry])
    reasons: list[str] = []
    for kind, changes in entry.items():
        if kind == "changed deps":
            for path, state in changes.items():
                if isinstance(state, dict):  # a params file: {key: "modified" | "new" | "deleted"}
                    reasons += params(path, state)
                else:
                    rel = rel_to(root, paths.get(path, path))
                    what = "code" if rel in code else "dep"
                    reasons.append(f"{what} {'missing' if state == 'deleted' else 'changed'}: {rel}")
        elif kind == "changed outs":
            reasons += [_out_reason(root, rel_to(root, paths.get(path, path)), state)
                        for path, state in changes.items()]
    return reasons


def rel_to(root: Path, path: str) -> str:
    """A path (absolute, or relative to the working directory) relative to the root."""
    if "://" in path:
        return path
    full = Path(os.path.abspath(path))
    return full.relative_to(root).as_posix() if full.is_relative_to(root) else str(full)


def _out_reason(root: Path, path: str, state: str) -> str:
    """An out DVC calls changed, in plain words (a fresh clone's outs are 'missing', not 'not in cache')."""
    if state == "deleted" or not os.path.lexists(root / path):
        return f"out missing: {path}"
    if state == "not in cache":
        return f"out not in the DVC cache: {path}"
    return f"out changed: {path}"


def params_changed(stage: PipelineStage, path: str, state: Mapping[str, str]) -> list[str]:
    """Leaf keys of a params file that changed (``params changed: train.lr 0.1 → 0.2``)."""
    from dvc.dependency.param import ParamsDependency

    for dep in stage.deps:
        if isinstance(dep, ParamsDependency) and str(dep) == path:
            old = dep.hash_info.value if dep.hash_info and isinstance(dep.hash_info.value, dict) else {}
            try:
                new = dep.read_params()
            except Exception:  # noqa: BLE001 - DVC reports a broken params file itself
                new = {}
            reasons: list[str] = []
            for key in state:
                was = {key: old[key]} if key in old else {}
                now = {key: new[key]} if key in new else {}
                reasons += param_changes(was, now) or [f"params changed: {key}"]
            return reasons
    return [f"params changed: {key}" for key in state]


def stage_status(stage: PipelineStage) -> dict[str, list[Any]]:
    """DVC's ``Stage.status`` (what ``dvc status`` prints) without the path lock it takes on each
    call (``rwlocked``: .dvc/tmp/rwlock read and rewritten twice, about half of the call). A
    record's session holds DVC's repository lock, which every DVC command needs to take a path
    lock, and found no DVC command holding one when it took it (:func:`conveyor.dvc.rwlock.running_dvc`):
    no other process reads or writes these paths meanwhile."""
    unlocked = getattr(type(stage).status, "__wrapped__", None)  # the function under DVC's decorator
    return dict(unlocked(stage) if unlocked is not None else stage.status())
