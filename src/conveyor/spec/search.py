"""``conveyor search STAGE``: what a search asks for, checked against the project before any trial.

A matrix is a product of lists; a search draws tuples. Each ``--param`` names a dotted key
of the params file and where its values come from::

    train.alpha=loguniform(1e-4,10)     a float, drawn on a log scale
    train.test_fraction=uniform(0.1,0.4)
    train.depth=int(2,8)                an integer, both ends included
    train.model=choice(ridge,lasso)     one of the values listed

The objective is a number in one of the stage's metrics files (``metrics/train.json:rmse``).
Everything here is pure data, checked with the project's spec and params: no sampler is
imported (Optuna is the run room's, :mod:`conveyor.run.search`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from conveyor.errors import UsageError, did_you_mean
from conveyor.spec.interpolate import dotted_keys, lookup

if TYPE_CHECKING:
    from conveyor.spec.project import Project

KINDS = ("uniform", "loguniform", "int", "choice")
SAMPLERS = ("tpe", "random", "grid")
_PARAM = re.compile(r"^\s*([\w.-]+)\s*=\s*(\w+)\s*\((.*)\)\s*$")
EXAMPLE = "e.g. --param 'train.alpha=loguniform(1e-4,10)', 'train.depth=int(2,8)', 'train.model=choice(a,b)'"


@dataclass(frozen=True)
class Dimension:
    """One searched param: its dotted key and the values a trial may give it."""

    key: str
    kind: str  # one of KINDS
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()

    @property
    def shown(self) -> str:
        args = ",".join(json.dumps(c) if isinstance(c, str) else str(c) for c in self.choices) \
            if self.kind == "choice" else f"{self.low:g},{self.high:g}"
        return f"{self.key}={self.kind}({args})"


@dataclass(frozen=True)
class Objective:
    """The number a search optimises: ``key`` of the metrics file ``file``."""

    file: str
    key: str
    minimize: bool

    @property
    def shown(self) -> str:
        return f"{self.file}:{self.key}"


@dataclass(frozen=True)
class Search:
    """A whole search: the stage, its space, the objective, the sampler and when to stop."""

    stage: str
    space: tuple[Dimension, ...]
    objective: Objective
    sampler: str = "tpe"
    trials: int = 16
    timeout_s: float | None = None
    seed: int | None = None
    prune: bool = False  # stop trials whose ctx.report values fall behind (Optuna's MedianPruner)

    @property
    def study(self) -> str:
        """The study's name: the same for the same stage, space, objective and sampler, so a search
        run again with those continues (``--trials`` and ``--timeout`` say only when to stop)."""
        what = json.dumps([self.stage, [d.shown for d in self.space], self.objective.shown,
                           self.objective.minimize, self.sampler, self.seed, *(["prune"] if self.prune else [])])
        return f"{self.stage}-{hashlib.sha256(what.encode()).hexdigest()[:10]}"


def parse_dimension(text: str) -> Dimension:
    """``train.alpha=loguniform(1e-4,10)`` as a Dimension; a UsageError saying how to write it."""
    found = _PARAM.match(text)
    if found is None:
        raise UsageError(f"--param {text!r}: write it as KEY=KIND(ARGS) with KIND one of {', '.join(KINDS)} "
                         f"({EXAMPLE})")
    key, kind, args = found.groups()
    if kind not in KINDS:
        raise UsageError(f"--param {text!r}: unknown kind '{kind}'{did_you_mean(kind, KINDS)} "
                         f"(kinds: {', '.join(KINDS)})")
    try:
        values = [_value(v) for v in yaml.safe_load(f"[{args}]")]
    except (yaml.YAMLError, TypeError):
        values = []
    if not values:
        raise UsageError(f"--param {text!r}: its values are not a list ({EXAMPLE})")
    if kind == "choice":
        return Dimension(key, kind, choices=tuple(values))
    return _ranged(text, key, kind, values)


def _value(value: Any) -> Any:
    """A value as written on the command line: ``1e-4`` is a number (YAML 1.1 would keep it a string)."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                continue
    return value


def _ranged(text: str, key: str, kind: str, values: list[Any]) -> Dimension:
    numbers = len(values) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or (kind == "int" and not all(isinstance(v, int) for v in values)):
        what = "two integers" if kind == "int" else "two numbers"
        raise UsageError(f"--param {text!r}: {kind}(LOW,HIGH) takes {what}")
    low, high = values
    if low >= high:
        raise UsageError(f"--param {text!r}: LOW must be below HIGH")
    if kind == "loguniform" and low <= 0:
        raise UsageError(f"--param {text!r}: loguniform draws on a log scale: LOW must be above 0")
    return Dimension(key, kind, low, high)


def parse_objective(text: str, *, minimize: bool) -> Objective:
    """``metrics/train.json:rmse`` as an Objective."""
    file, colon, key = text.rpartition(":")
    if not colon or not file or not key:
        raise UsageError(f"--objective {text!r}: write it as METRICS_FILE:KEY (e.g. metrics/train.json:rmse)")
    return Objective(file.strip(), key.strip(), minimize)


def check_search(project: Project, search: Search) -> None:
    """Every problem of ``search`` against the project, in one UsageError, before anything runs."""
    if project.dvc is not None:
        raise UsageError("conveyor search runs the stages of a conveyor spec (configs/pipeline.yaml); "
                         f"{project.rel(project.spec_path)} is a dvc.yaml: use `dvc exp run` there")
    stages = project.pipeline.stages
    if search.stage not in stages:
        items = [s for s in stages if s.startswith(f"{search.stage}@")]
        why = f"'{search.stage}' is a matrix ({len(items)} items): search one of its items or a plain stage" \
            if items else f"unknown stage '{search.stage}'{did_you_mean(search.stage, stages)}"
        raise UsageError(f"search: {why} (stages: {', '.join(project.order)})")
    problems = [p for d in search.space if (p := _dimension_problem(project, search.stage, d, search.sampler))]
    keys = [d.key for d in search.space]
    problems += [f"--param {k} is given twice: give it once" for k in dict.fromkeys(keys) if keys.count(k) > 1]
    if not search.space:
        problems.append(f"say what to search with --param ({EXAMPLE})")
    metrics = project.metrics_of(search.stage)
    if search.objective.file not in metrics:
        listed = ", ".join(metrics) or "none: declare one under its metrics:"
        problems.append(f"--objective {search.objective.shown}: {search.objective.file} is not a metrics file "
                        f"of {search.stage} (its metrics: {listed})")
    if problems:
        raise UsageError("; ".join(problems))


def _dimension_problem(project: Project, stage: str, dim: Dimension, sampler: str) -> str | None:
    """What is wrong with searching ``dim`` for ``stage``; None when nothing is."""
    name = project.rel(project.params_path)
    try:
        old = lookup(project.params, dim.key)
    except KeyError:
        return (f"--param {dim.key}: {name} has no key '{dim.key}'"
                f"{did_you_mean(dim.key, list(dotted_keys(project.params)))} (a search sets params the file has)")
    declared = project.pipeline.stages[stage].params
    if not any(dim.key == k or dim.key.startswith(f"{k}.") for k in declared):
        return (f"--param {dim.key}: {stage} does not read it (its params: {', '.join(declared) or 'none'}), "
                "so no trial would differ")
    if isinstance(old, bool) or (isinstance(old, int) and dim.kind in ("uniform", "loguniform")):
        return f"--param {dim.key}: it is {json.dumps(old)} in {name}: search it with int(LOW,HIGH) or choice(...)"
    if isinstance(old, str | list | dict) and dim.kind != "choice":
        return f"--param {dim.key}: it is no number in {name}: search it with choice(...)"
    if sampler == "grid" and dim.kind in ("uniform", "loguniform"):
        return f"--param {dim.key}: the grid sampler needs values it can list: int(LOW,HIGH) or choice(...)"
    return None


def grid_of(space: Sequence[Dimension]) -> dict[str, list[Any]]:
    """The values a grid search walks, per key (only int and choice dimensions have a grid)."""
    return {d.key: list(range(int(d.low), int(d.high) + 1)) if d.kind == "int" else list(d.choices)
            for d in space}


def as_param(value: Any, old: Any) -> Any:
    """A drawn value as the params file has its kind: an int drawn for a float param is a float."""
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def current(project: Project, space: Sequence[Dimension]) -> Mapping[str, Any]:
    """The values the params file holds now, for the keys searched (the search's first trial, where
    they lie in its space: the point every trial is compared with)."""
    return {d.key: lookup(project.params, d.key) for d in space}
