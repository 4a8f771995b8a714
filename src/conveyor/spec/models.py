"""The pipeline spec of SPEC.md section 2, as frozen pydantic models.

Pure data: structural validation only. The profiles are in :mod:`conveyor.spec.profiles`, the
reading of a loaded YAML into these models (every problem at once, with file:line) in
:mod:`conveyor.spec.parse`. Cross-references (profiles, needs, params keys, tasks, paths) are
checked in :mod:`conveyor.spec.project`, the graph in :mod:`conveyor.plan.dag`. Nothing here
imports Prefect, Dask or DVC.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from functools import partial
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from conveyor.spec.base import Model
from conveyor.spec.profiles import Profile

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
TASK_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _normalised(path: str) -> str:
    """``./data/raw/`` and ``data/raw`` are one path (for edges and duplicate outs)."""
    return path if "://" in path else posixpath.normpath(path)


class Declared(Model):
    """One path a stage declares: as written (normalised), its name if it has one, and
    ``persist`` (outs only: left in place while the stage runs, as in DVC)."""

    path: str
    name: str | None = None
    persist: bool = False

    _path = field_validator("path")(_normalised)


def _declared(value: Any, *, outs: bool) -> Any:
    """The forms a stage may write its paths in, as :class:`Declared` items.

    A list of paths (``[data/raw]``), where an out may carry DVC's options
    (``- models/ckpt: {persist: true}``); or a mapping from names to paths
    (``{data: data/processed, model: models/xgb.json}``), where a task finds each by name.
    """
    if isinstance(value, Mapping):
        return [_named(str(name), body, outs=outs) for name, body in value.items()]
    if not isinstance(value, list | tuple):
        return value  # pydantic names the type it expected
    items: list[Any] = []
    for item in value:
        if outs and isinstance(item, Mapping) and len(item) == 1:
            ((path, options),) = item.items()
            if options is not None and not isinstance(options, Mapping):
                raise ValueError(f"'{path}': options of an out are a mapping, e.g. {{persist: true}}")
            items.append({"path": path, **(options or {})})
        else:
            items.append({"path": item} if isinstance(item, str) else item)
    return items


def _named(name: str, body: Any, *, outs: bool) -> Any:
    if not NAME.match(name):
        raise ValueError(f"'{name}' is not a name: start with a letter; letters, digits, _ and - only")
    if isinstance(body, str):
        return {"path": body, "name": name}
    if outs and isinstance(body, Mapping):
        return {**body, "name": name}
    raise ValueError(f"'{name}' must be a path" + (" or {path: ..., persist: true}" if outs else ""))


# A duration: finite (``.inf`` would overflow the timers it is given to; no timeout is no key)
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Resources = dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")],
                 Annotated[float, Field(gt=0, allow_inf_nan=False)]]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Deps = Annotated[tuple[Declared, ...], BeforeValidator(partial(_declared, outs=False))]
Outs = Annotated[tuple[Declared, ...], BeforeValidator(partial(_declared, outs=True))]


class Stage(Model):
    """One step of the pipeline: a task or a command, what it reads and writes, where it runs.

    ``deps``, ``outs`` and ``metrics`` are read as paths (tuples of strings); each may be
    written as a list or as a mapping of names to paths (:func:`_declared`).
    """

    task: str | None = None
    cmd: str | tuple[str, ...] | None = None
    wdir: str | None = None
    on: str | None = None
    needs: tuple[str, ...] = ()
    dep_items: Deps = Field(default=(), alias="deps")
    params: tuple[str, ...] = ()
    out_items: Outs = Field(default=(), alias="outs")
    metric_items: Outs = Field(default=(), alias="metrics")
    retries: Annotated[int, Field(ge=0)] = 0
    retry_delay_s: Seconds = 0.0
    timeout_s: PositiveSeconds | None = None
    # the same bytes on any x86-64 CPU: pinned kernel paths and one thread (conveyor.run.determinism)
    deterministic: bool = False
    # Dask resources the stage holds while it runs ({GPU: 1}): workers of its profile that declare
    # them, held whole (conveyor.run.held); a task's units may span workers, a command's are on one
    resources: Resources | None = None
    desc: str | None = None

    @field_validator("task")
    @classmethod
    def _task_ref(cls, value: str | None) -> str | None:
        if value is not None and not TASK_REF.match(value):
            raise ValueError(f"'{value}' is not a task: write it as module:function")
        return value

    @field_validator("cmd")
    @classmethod
    def _some_command(cls, value: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if value is None:
            return None
        commands = (value,) if isinstance(value, str) else value
        if not commands or not all(c.strip() for c in commands):
            raise ValueError("an empty command: write the shell command to run")
        return value

    @model_validator(mode="after")
    def _task_or_cmd(self) -> Stage:
        if (self.task is None) == (self.cmd is None):
            raise ValueError("a stage runs a task (module:function) or a cmd (a shell command): give exactly one")
        if self.wdir is not None and self.cmd is None:
            raise ValueError("'wdir' is where a cmd runs: a task stage has none")
        names = [i.name for i in self.dep_items + self.out_items + self.metric_items if i.name is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"the name {', '.join(map(repr, twice))} is given to more than one path of "
                             "deps, outs and metrics: a name finds one path")
        return self

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.dep_items)

    @property
    def outs(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.out_items)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.metric_items)

    @property
    def written(self) -> tuple[str, ...]:
        """Every path this stage writes: outs, then metrics."""
        return self.outs + self.metrics

    @property
    def persist(self) -> frozenset[str]:
        """Outs left in place while the stage runs (``persist: true``)."""
        return frozenset(i.path for i in self.out_items + self.metric_items if i.persist)

    @property
    def names(self) -> dict[str, str]:
        """Named deps, outs and metrics: name -> path (a task finds them by name)."""
        return {i.name: i.path for i in self.dep_items + self.out_items + self.metric_items if i.name is not None}

    @property
    def commands(self) -> tuple[str, ...]:
        """A cmd stage's commands, run one after another (a list ``cmd``, as in DVC)."""
        return (self.cmd,) if isinstance(self.cmd, str) else tuple(self.cmd or ())

    @property
    def module(self) -> str:
        return (self.task or "").partition(":")[0]

    @property
    def function(self) -> str:
        return (self.task or "").partition(":")[2]


class ModelSpec(Model):
    """How the project's model predicts (SPEC.md §2.4): ``conveyor predict`` and ``serve-model``.

    ``files`` name the outs that make up the model (its version is their hash); ``features``
    the input columns, in order: a list, or ``FILE:KEY`` (a JSON list in one of those files).
    ``load(files) -> model`` runs once per version; ``predict(model, rows) -> scores``, one per row
    (without ``load`` it gets the files, name -> path).
    """

    files: dict[str, str]
    features: str | tuple[str, ...]
    predict: str
    load: str | None = None
    id: str | None = None  # the input's id column, copied to the scores predict writes
    registry: str = "models/registry.json"  # where retraining records the champion

    @field_validator("files")
    @classmethod
    def _some_files(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("name the outs that make up the model (name: path)")
        bad = [n for n in value if not NAME.match(n)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: a name starts with a letter and holds only letters, "
                             "digits, _ and -")
        return value

    @field_validator("predict", "load")
    @classmethod
    def _function_ref(cls, value: str | None) -> str | None:
        if value is not None and not TASK_REF.match(value):
            raise ValueError(f"'{value}' is not a function: write it as module:function")
        return value

    @model_validator(mode="after")
    def _features_known(self) -> ModelSpec:
        if isinstance(self.features, str):
            path, sep, key = self.features.rpartition(":")
            if not sep or not key or path not in self.files.values():
                raise ValueError(f"features '{self.features}': give the columns as a list, or as FILE:KEY "
                                 f"where FILE is one of the model's files ({', '.join(self.files.values())})")
        elif not self.features or len(set(self.features)) != len(self.features):
            raise ValueError("features: the input columns, each once")
        return self


class Pipeline(Model):
    """A whole spec file."""

    pipeline: str
    params: str = "params.yaml"
    task_packages: tuple[str, ...] = ("tasks",)
    profiles: dict[str, Profile] = Field(default_factory=dict)
    stages: dict[str, Stage]
    model: ModelSpec | None = None

    @field_validator("stages")
    @classmethod
    def _not_empty(cls, value: dict[str, Stage]) -> dict[str, Stage]:
        if not value:
            raise ValueError("a pipeline needs at least one stage")
        return value


class Placement(Model):
    """Where the stages a glob matches run, and how they retry (a dvc.yaml's stages)."""

    on: str | None = None
    retries: Annotated[int, Field(ge=0)] | None = None
    retry_delay_s: Seconds | None = None
    timeout_s: PositiveSeconds | None = None
    deterministic: bool | None = None


class DvcPipeline(Model):
    """A spec that runs an existing dvc.yaml as it is, adding only where its stages run.

    ``placement`` maps stage-name globs (``train@*``) to a :class:`Placement`; every glob
    that matches a stage applies, later ones overriding earlier ones key by key.
    """

    pipeline: str | None = None
    dvc: str = "dvc.yaml"
    profiles: dict[str, Profile] = Field(default_factory=dict)
    placement: dict[str, Placement] = Field(default_factory=dict)
    model: ModelSpec | None = None  # what predict and serve-model score with (SPEC.md §2.4)


