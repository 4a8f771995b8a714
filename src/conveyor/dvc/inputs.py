"""A stage's inputs as it started, against DVC's reading of them after it ran.

DVC hashes a stage's deps and reads its params after the command, so a params file edited
while the stage ran is recorded with values the outs were never made from, and ``dvc status``
is clean (dvc#11058). conveyor notes them as the stage starts and records those.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.dvc.reasons import rel_to
from conveyor.plan.fingerprint import param_changes

if TYPE_CHECKING:
    from dvc.stage import PipelineStage


def started_inputs(stage: PipelineStage) -> dict[str, tuple[Any, Any]]:
    """Each dep's hash (a params file: its values) and meta, as DVC computes them now; a dep DVC
    cannot hash now (missing, unreachable) is left out: DVC reports it after the run itself."""
    from dvc.dependency.param import ParamsDependency
    from dvc.exceptions import DvcException

    found: dict[str, tuple[Any, Any]] = {}
    for dep in stage.deps:
        try:
            if isinstance(dep, ParamsDependency):
                found[str(dep)] = (dep.get_hash(), None)
            else:  # DVC's state database keeps it: hashed again after the run, it is a lookup
                meta, hash_info = dep._get_hash_meta()  # what Output.save computes
                found[str(dep)] = (hash_info, meta)
        except (OSError, DvcException):
            continue
    return found


def as_started(stage: PipelineStage, started: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """Put back, on the saved stage, each dep as it was when it started; the changes, in words."""
    from dvc.dependency.param import ParamsDependency

    changed: list[str] = []
    for dep in stage.deps:
        # the value, not the whole hash: a dep new to dvc.lock is hashed md5-dos2unix as the stage
        # starts (DVC's name for a dep it has no record of) and md5 once DVC saves it
        if str(dep) not in started or getattr(started[str(dep)][0], "value", None) == dep.hash_info.value:
            continue
        hash_info, meta = started[str(dep)]
        if isinstance(dep, ParamsDependency):
            was, now = dict(hash_info.value or {}), dict(dep.hash_info.value or {})
            changed += param_changes(was, now) or [f"params changed: {dep}"]
        else:
            changed.append(f"dep changed: {rel_to(Path(stage.repo.root_dir), dep.fs_path)}")
            dep.meta = meta
        dep.hash_info = hash_info
    return changed



_EXPR = re.compile(r"(?<!\\)\$\{\s*([^}]*?)\s*\}")  # DVC's ${...}; \${ is a literal


def command_changes(stage: PipelineStage, recorded: Any) -> list[str] | None:
    """DVC's "changed command", in the words of the ``${...}`` values that changed
    (``params changed: train.lr 0.1 → 0.2``) when dvc.yaml's command, as written, yields both
    the recorded command and today's with only those values different; None when the
    command's text itself changed (or DVC's parser keeps no template for it)."""
    template = _cmd_template(stage)
    templates, now, was = _listed(template), _listed(stage.cmd), _listed(recorded)
    if template is None or not (len(templates) == len(now) == len(was)):
        return None
    changes: list[str] = []
    for text, current, before in zip(templates, now, was, strict=True):
        exprs = _EXPR.findall(text)
        literal = _EXPR.split(text)[::2]  # split keeps the groups: every other piece is literal
        pattern = re.compile("(.*?)".join(re.escape(part.replace("\\${", "${")) for part in literal), re.DOTALL)
        then, today = pattern.fullmatch(before), pattern.fullmatch(current)
        if then is None or today is None:
            return None
        for expr, a, b in zip(exprs, then.groups(), today.groups(), strict=True):
            changes += param_changes({expr: a}, {expr: b})
    return list(dict.fromkeys(changes)) or None  # one line per param, however often the command uses it


def _cmd_template(stage: PipelineStage) -> Any:
    """The stage's ``cmd`` as dvc.yaml writes it (``foreach``/``matrix``: the template's)."""
    try:
        definition = stage.dvcfile.resolver.definitions[stage.name.split("@")[0]]
    except (AttributeError, KeyError):
        return None
    raw = getattr(definition, "definition", None) or getattr(definition, "_template", None)
    return raw.get("cmd") if isinstance(raw, Mapping) else None


def _listed(cmd: Any) -> list[str]:
    return [cmd] if isinstance(cmd, str) else [str(c) for c in cmd] if isinstance(cmd, list) else []


def recorded_cmd(lock: Path, stage: str) -> Any:
    """``stage``'s command as the dvc.lock at ``lock`` records it (None: not recorded, unreadable)."""
    import yaml

    try:
        data = yaml.load(lock.read_text(encoding="utf-8"),
                         Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except (OSError, yaml.YAMLError):
        return None
    return ((data or {}).get("stages") or {}).get(stage, {}).get("cmd")
