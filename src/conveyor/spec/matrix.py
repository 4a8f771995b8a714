"""``matrix:`` in a spec: one stage per combination of its values, as DVC expands it.

    train:                                   train@0.1-6   {eta: 0.1, max_depth: 6}
      matrix: {eta: [0.1, 0.3],        →     train@0.1-8   {eta: 0.1, max_depth: 8}
               max_depth: [6, 8]}            train@0.3-6   ...
      outs: [models/xgb-${item.eta}-${item.max_depth}.json]

Items are named as DVC names them (the values joined with ``-``, a list or mapping value
as its key and index: ``train@model0-6``), so ``dvc repro train@0.1-6`` and ``conveyor run
train@0.1-6`` are one stage. In ``cmd``, ``wdir``, ``deps``, ``outs`` and ``metrics``,
``${item.key}`` is the item's value and ``${key}`` its name after the ``@``; a matrix list
may itself come from the params file (``eta: ${train.etas}``). ``needs: [train]`` means
every item. The expansion works on the raw YAML, before ``${...}`` from the params file
is replaced and before the stages are checked, so every check sees ordinary stages and
reports at the line of the matrix stage.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import SpecIssue
from conveyor.spec.interpolate import InterpolationError, interpolate_stage, lookup
from conveyor.spec.yamlmap import Key, LoadedYaml

JOIN = "@"
MATRIX = "matrix"
ITEM_NAME = re.compile(r"^[\w.+-]+$")
_WHOLE = re.compile(r"^\$\{\s*([^}]+?)\s*\}$")
MAX_ITEMS = 10_000  # a typo in a matrix should not make a million stages


@dataclass(frozen=True)
class Expanded:
    """A spec with every ``matrix`` stage replaced by its items."""

    doc: LoadedYaml
    items: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # item stage -> its values
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # matrix stage -> its items, in order
    written: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # matrix stage -> its body as written
    issues: list[SpecIssue] = field(default_factory=list)


def expand(doc: LoadedYaml, params: Mapping[str, Any]) -> Expanded:
    """``doc`` with each matrix stage expanded (the same object when there is none)."""
    raw = doc.data if isinstance(doc.data, dict) else {}
    stages = raw.get("stages")
    if not isinstance(stages, dict) or not any(isinstance(b, dict) and MATRIX in b for b in stages.values()):
        return Expanded(doc)
    issues: list[SpecIssue] = []
    out: dict[Any, Any] = {}
    lines = dict(doc.lines)
    items: dict[str, Mapping[str, Any]] = {}
    groups: dict[str, tuple[str, ...]] = {}
    written: dict[str, Mapping[str, Any]] = {}

    def issue(key: Key, message: str) -> None:
        issues.append(SpecIssue(doc.path, doc.line(key), ".".join(map(str, key)), message))

    for name, body in stages.items():
        if not isinstance(body, dict) or MATRIX not in body:
            out[name] = body
            continue
        where: Key = ("stages", str(name), MATRIX)
        combos = _combinations(body[MATRIX], params, where, issue)
        if combos is None:
            out[name] = {k: v for k, v in body.items() if k != MATRIX}  # checked as a plain stage
            continue
        names: list[str] = []
        for key, item in combos.items():
            stage = f"{name}{JOIN}{key}"
            if stage in stages:
                issue(where, f"its item '{stage}' has the name of another stage: rename one of them")
                continue
            expanded, problems = interpolate_stage({k: v for k, v in body.items() if k != MATRIX},
                                                   {"item": item, "key": key}, only=of_item)
            for path, message in problems:
                issue(("stages", str(name), *path), message)
            if problems and names:  # its other items would only repeat them
                break
            out[stage] = expanded
            items[stage] = item
            names.append(stage)
            lines.update({("stages", stage, *k[2:]): n for k, n in doc.lines.items()
                          if k[:2] == ("stages", name)})
        groups[str(name)] = tuple(names)
        written[str(name)] = body
    for body in out.values():
        if isinstance(body, dict) and isinstance(body.get("needs"), list):
            body["needs"] = [s for need in body["needs"] for s in groups.get(need, (need,))]
    # problems repeated in every item are reported once
    issues = list(dict.fromkeys(issues))
    data = {**raw, "stages": out}
    return Expanded(LoadedYaml(doc.path, data, lines, doc.duplicates), items, groups, written, issues)


def group_key(key: str, items: Mapping[str, Any]) -> str:
    """A key path naming an item as one naming its matrix stage: ``stages.train@0.1-6.on`` → ``stages.train.on``."""
    for item in items:
        prefix = f"stages.{item}"
        if key == prefix or key.startswith(f"{prefix}."):
            return f"stages.{item.partition(JOIN)[0]}{key[len(prefix):]}"
    return key


def of_item(key: str) -> bool:
    """``${item}``, ``${item.eta}``, ``${key}``: what an item fills in."""
    return key in ("item", "key") or key.startswith("item.")


def _combinations(matrix: Any, params: Mapping[str, Any], where: Key,
                  issue: Callable[[Key, str], None]) -> dict[str, dict[str, Any]] | None:
    """Item name -> item for a ``matrix:`` mapping, in DVC's order; None (and issues) when it is wrong."""
    if not isinstance(matrix, dict) or not matrix:
        issue(where, "a matrix is a mapping of names to lists of values, e.g. {eta: [0.1, 0.3]}")
        return None
    lists: dict[str, list[Any]] = {}
    for key, values in matrix.items():
        if isinstance(values, str) and (whole := _WHOLE.match(values)):
            try:
                values = lookup(params, whole.group(1))
            except KeyError:
                issue((*where, key), str(InterpolationError(f"unknown param key '{values}'")))
                return None
        if not isinstance(values, list) or not values:
            issue((*where, key), f"'{key}' must list its values (a non-empty list, or ${{key}} of a list in the "
                                 f"params file); got {values!r:.60}")
            return None
        lists[str(key)] = values
    count = 1
    for values in lists.values():
        count *= len(values)
    if count > MAX_ITEMS:
        issue(where, f"{count:,} combinations: more than {MAX_ITEMS:,} stages; split the matrix")
        return None
    combos: dict[str, dict[str, Any]] = {}
    for combination in itertools.product(*(list(enumerate(v)) for v in lists.values())):
        item = {k: v for k, (_, v) in zip(lists, combination, strict=True)}
        fragments = [f"{k}{i}" if isinstance(v, list | dict) else _to_str(v)
                     for k, (i, v) in zip(lists, combination, strict=True)]
        name = "-".join(fragments)
        if not ITEM_NAME.match(name):
            issue(where, f"the item '{name}': values name the stages of a matrix, so they hold only letters, "
                         "digits and . _ - + (a list or mapping value is named by its key and index)")
            return None
        if name in combos:
            issue(where, f"two combinations are both named '{name}' (values that print alike, e.g. 1 and '1'): "
                         "make them differ")
            return None
        combos[name] = item
    return combos


def _to_str(value: Any) -> str:
    """A value in an item's name, as DVC writes it (``true``, not ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
