"""A loaded spec into its models, every problem at once with file:line (SPEC.md section 2)."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from conveyor.errors import SpecError, SpecIssue, did_you_mean
from conveyor.spec.base import Model
from conveyor.spec.models import NAME, DvcPipeline, ModelSpec, Pipeline, Placement, Stage
from conveyor.spec.profiles import PROFILE_KINDS, DaskCudaProfile, DaskProfile, SlurmProfile, ThreadsProfile
from conveyor.spec.yamlmap import LoadedYaml


def parse_dvc_pipeline(doc: LoadedYaml) -> DvcPipeline:
    """Validate a placement spec (``dvc: dvc.yaml``); every problem is reported at once."""
    try:
        return DvcPipeline.model_validate(doc.data)
    except ValidationError as exc:
        issues = [_issue(doc, dict(err)) for err in exc.errors()]
        raise SpecError(sorted(issues, key=lambda i: i.line or 0)) from None


# a file name holds 255 bytes (NAME_MAX): a stage's journal entry is `.NAME-xxxxxxxx.done` while it is dropped
MAX_NAME = 255 - len(".-xxxxxxxx.done")


def parse_pipeline(doc: LoadedYaml, items: Iterable[str] = ()) -> Pipeline:
    """Validate the structure of a loaded spec; every problem is reported at once.

    ``items``: stage names a matrix made (``train@0.1-6``), whose group name is checked instead.
    """
    if not isinstance(doc.data, dict):
        raise SpecError([SpecIssue(doc.path, 1, "", "a spec is a mapping with 'pipeline' and 'stages'")])
    stages = doc.data.get("stages")
    made = frozenset(items)
    issues = [
        SpecIssue(doc.path, doc.line(("stages", name)), f"stages.{name}",
                  "a stage name starts with a letter and holds only letters, digits, _ and -")
        for name in (stages if isinstance(stages, dict) else {})
        if not NAME.match(str(name).partition("@")[0] if name in made else str(name))
    ]
    issues += [
        SpecIssue(doc.path, doc.line(("stages", name)) or doc.line(("stages", str(name).partition("@")[0])),
                  f"stages.{name}", f"a stage name of {len(str(name).encode())} bytes is too long: a run names "
                  f"the stage's log file and journal entry after it, which leaves at most {MAX_NAME} bytes"
                  + ("; shorten the matrix's values or its name" if name in made else ""))
        for name in (stages if isinstance(stages, dict) else {}) if len(str(name).encode()) > MAX_NAME
    ]
    try:
        pipeline = Pipeline.model_validate(doc.data)
    except ValidationError as exc:
        issues += [_issue(doc, dict(err)) for err in exc.errors()]
        raise SpecError(sorted(issues, key=lambda i: i.line or 0)) from None
    if issues:
        raise SpecError(issues)
    return pipeline


def _issue(doc: LoadedYaml, err: dict[str, Any]) -> SpecIssue:
    loc = _clean_loc(err["loc"], doc.data)
    key = ".".join(str(p) for p in loc)
    line = doc.line(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1], doc.data)
        hint = did_you_mean(str(loc[-1]), allowed)
        listing = f"; allowed: {', '.join(sorted(allowed))}" if not hint else ""
        return SpecIssue(doc.path, line, key, f"unknown key '{loc[-1]}'{hint}{listing}")
    if kind == "union_tag_invalid":
        tag = str(err.get("ctx", {}).get("tag", ""))
        hint = did_you_mean(tag, PROFILE_KINDS)
        return SpecIssue(doc.path, doc.line((*loc, "kind")), f"{key}.kind",
                         f"unknown profile kind '{tag}'{hint}; kinds: {', '.join(PROFILE_KINDS)}")
    if kind == "union_tag_not_found":
        return SpecIssue(doc.path, line, key, f"a profile needs 'kind' ({', '.join(PROFILE_KINDS)})")
    if kind == "missing":
        return SpecIssue(doc.path, line, key, "is required")
    if kind == "value_error":
        return SpecIssue(doc.path, line, key, str(err["msg"]).removeprefix("Value error, "))
    return SpecIssue(doc.path, line, key, f"{err['msg']} (got {_PREVIEW.repr(err.get('input'))})")


# What a message shows of a wrong value: all of a small one, the start of a big one (a list of
# 50,000 items, a string of a megabyte) so that each problem stays one readable line.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxstring = _PREVIEW.maxother = 80
_PREVIEW.maxlist = _PREVIEW.maxtuple = _PREVIEW.maxset = 8
_PREVIEW.maxdict = 4


def _clean_loc(loc: tuple[Any, ...], data: Any) -> tuple[str | int, ...]:
    """Drop pydantic's union-tag segment (``profiles.cpu.dask.x`` → ``profiles.cpu.x``)."""
    parts = list(loc)
    if len(parts) > 2 and parts[0] == "profiles" and parts[2] in PROFILE_KINDS:
        del parts[2]
    return tuple(parts)


def _allowed_keys(parent: tuple[str | int, ...], data: Any) -> list[str]:
    if not parent:
        return list(DvcPipeline.model_fields if "dvc" in data else Pipeline.model_fields)
    if parent[0] == "placement" and len(parent) == 2:
        return list(Placement.model_fields)
    if parent == ("model",):
        return list(ModelSpec.model_fields)
    if parent[0] == "stages" and len(parent) == 2:
        written = [field.alias or name for name, field in Stage.model_fields.items()]
        return written if "@" in str(parent[1]) else [*written, "matrix"]  # an item's matrix is spent
    if parent[0] == "stages" and len(parent) == 4 and parent[2] in ("outs", "metrics"):
        return ["persist"]
    if parent[0] == "profiles" and len(parent) == 2:
        kind = (data.get("profiles") or {}).get(parent[1], {}).get("kind")
        models: dict[str, type[Model]] = {"threads": ThreadsProfile, "dask": DaskProfile,
                                          "dask-cuda": DaskCudaProfile, "slurm": SlurmProfile}
        model = models.get(str(kind))
        return list(model.model_fields) if model else []
    return []
