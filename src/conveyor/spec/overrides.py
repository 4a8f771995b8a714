"""``conveyor run -S key=value``: set a param for a run, as ``dvc exp run -S`` does.

The value is written into the params file (its comments and layout kept), so the run,
its record and ``dvc.lock`` all see one value, and the stages that read the key are stale
the way an edit of the file makes them: nothing else needs to know about overrides. As
with ``dvc exp run -S``, the file keeps the value after the run.

A value is typed like the one it replaces: ``-S train.eta=0.3`` over ``eta: 0.1`` is the
float 0.3, over ``model: xgb`` the string ``"0.3"``; a value that cannot be of that type
(``-S train.rounds=many`` over ``rounds: 100``) is refused, as is a key the file lacks
(did-you-mean), before anything is written. ``FILE:key=value`` edits another params file,
as DVC's ``-S`` syntax allows.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from conveyor.errors import UsageError, did_you_mean
from conveyor.spec.interpolate import dotted_keys, lookup
from conveyor.spec.yamlmap import load_yaml
from conveyor.workspace import replace_atomically

if TYPE_CHECKING:
    from conveyor.spec.project import Project

YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Override:
    """One ``-S``: the params file, the dotted key, its value now and the one it gets."""

    path: Path
    key: str
    old: Any
    new: Any
    shown: str  # the key as the record and the messages show it: ``train.eta`` or ``other.yaml:train.eta``


def parse_overrides(pairs: Sequence[str], root: Path, params_path: Path) -> list[Override]:
    """Check every ``-S`` (all problems in one UsageError), typed against the params file it names."""
    found: list[Override] = []
    problems: list[str] = []
    cache: dict[Path, Mapping[str, Any]] = {}
    for pair in pairs:
        try:
            found.append(_override(pair, root, params_path, cache))
        except UsageError as exc:
            problems.append(str(exc))
    keys = [o.shown for o in found]
    twice = dict.fromkeys(k for k in keys if keys.count(k) > 1)
    problems += [f"-S {key} is given twice: give it once" for key in twice]
    if problems:
        raise UsageError("; ".join(problems))
    return found


def _override(pair: str, root: Path, params_path: Path, cache: dict[Path, Mapping[str, Any]]) -> Override:
    target, sep, text = pair.partition("=")
    file, colon, key = target.rpartition(":") if ":" in target else ("", "", target)
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"-S {pair!r}: write it as key=value (e.g. -S train.eta=0.3), or FILE:key=value")
    path = (root / file).resolve() if colon else params_path
    shown = f"{file}:{key}" if colon else key
    if not path.is_relative_to(root.resolve()):
        raise UsageError(f"-S {pair!r}: {file} lies outside the project")
    if path.suffix.lower() not in YAML_SUFFIXES:
        raise UsageError(f"-S {shown}: {path.name} is not a YAML file; -S edits YAML params files (edit it by hand)")
    if path not in cache:
        cache[path] = _params(path, shown)
    params = cache[path]
    try:
        old = lookup(params, key)
    except KeyError:
        raise UsageError(f"-S {shown}: {path.name} has no key '{key}'{did_you_mean(key, list(dotted_keys(params)))}"
                         " (-S changes a param the file has)") from None
    return Override(path, key, old, _typed(text, old, shown, path.name), shown)


def _params(path: Path, shown: str) -> Mapping[str, Any]:
    if not path.is_file():
        raise UsageError(f"-S {shown}: params file {path} not found")
    try:
        data = load_yaml(path).data
    except yaml.YAMLError as exc:
        raise UsageError(f"-S {shown}: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"-S {shown}: {path} is not a mapping of keys to values")
    return data


def _typed(text: str, old: Any, shown: str, file: str) -> Any:
    """``text`` as a value of the type of ``old``; a UsageError when it cannot be one."""
    if isinstance(old, str):
        return text
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    kinds: list[tuple[type | tuple[type, ...], str]] = [
        (bool, "true or false"), (int, "an integer"), (float, "a number"), (list, "a list"), (dict, "a mapping")]
    for kind, described in kinds:
        if not isinstance(old, kind):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        raise UsageError(f"-S {shown}={text}: {shown} is {described} in {file} ({_text(old)}); give {described}")
    return value  # a null in the file: any value


def rendered(overrides: Sequence[Override]) -> dict[Path, str]:
    """The text each params file gets with its ``-S`` values set; nothing is written.

    Round-tripped through ruamel.yaml (DVC's dependency, as ``dvc exp run -S`` edits params
    files with it): comments and layout stay, and a value written ``[0.1, 10.0]`` stays a
    flow list rather than becoming a block one.
    """
    from ruamel.yaml import YAML

    by_file: dict[Path, list[Override]] = {}
    for override in overrides:
        by_file.setdefault(override.path, []).append(override)
    texts: dict[Path, str] = {}
    for path, changes in by_file.items():
        rt = YAML()
        rt.preserve_quotes = True
        document = rt.load(path.read_text(encoding="utf-8"))
        for change in changes:
            *parents, last = change.key.split(".")
            node = document
            for part in parents:
                node = node[part]
            node[last] = _styled(node[last], change.new)
        text = io.StringIO()
        rt.dump(document, text)
        texts[path] = text.getvalue()
    return texts


def _styled(old: Any, new: Any) -> Any:
    """``new`` as a ruamel node written in the style of ``old`` (a flow list stays a flow list)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    node: CommentedSeq | CommentedMap
    if isinstance(new, list) and isinstance(old, CommentedSeq):
        node = CommentedSeq(new)
    elif isinstance(new, dict) and isinstance(old, CommentedMap):
        node = CommentedMap(new)
    else:
        return new
    if old.fa.flow_style():
        node.fa.set_flow_style()
    return node


def write_rendered(texts: Mapping[Path, str]) -> None:
    """Write what :func:`rendered` made, each file replaced atomically."""
    for path, text in texts.items():
        replace_atomically(path, text)


def write_overrides(overrides: Sequence[Override]) -> None:
    """Set each value in its file, keeping the file's comments and layout."""
    write_rendered(rendered(overrides))


def describe(override: Override, root: Path) -> str:
    """``params.yaml: train.eta 0.1 → 0.3``"""
    where = override.path.relative_to(root.resolve()).as_posix() if override.path.is_relative_to(root.resolve()) \
        else str(override.path)
    return f"{where}: {override.key} {_text(override.old)} → {_text(override.new)}"


def _text(value: Any) -> str:
    """A value as YAML writes it: ``true``, ``0.3``, ``'xgb'``, ``[1, 2]``."""
    return repr(value) if isinstance(value, str) else json.dumps(value)


def reads(project: Project, stage: str, override: Override) -> bool:
    """True when ``stage`` declares a params key that ``override`` changes (``train`` reads ``train.eta``)."""
    if override.path != project.params_path:
        return False
    key = override.key
    return any(k == key or key.startswith(f"{k}.") or k.startswith(f"{key}.")
               for k in project.pipeline.stages[stage].params)
