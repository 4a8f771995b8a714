"""A DVC stage as a conveyor stage: what a run needs of it (command, paths relative to the
project root, wdir, persist, metrics) and what conveyor cannot honour in it, each problem at its
line of the dvc.yaml that declares it; and what the run record keeps of it (the params it
declares, with their values now; the foreach/matrix item it was made from).

DVC is imported only here and only when a dvc.yaml is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from conveyor.errors import SpecIssue
from conveyor.spec.checks import link_problem
from conveyor.spec.models import Stage
from conveyor.spec.yamlmap import LoadedYaml

if TYPE_CHECKING:
    from dvc.stage import PipelineStage


def converted(root: Path, dvc_file: Path, written: LoadedYaml, stages: Mapping[str, PipelineStage]
               ) -> tuple[dict[str, Stage], list[SpecIssue]]:
    """``stages`` of ``dvc_file`` (by the name conveyor gives them) as conveyor stages, and what
    conveyor cannot honour in them, each at its line of ``dvc_file``."""
    issues: list[SpecIssue] = []
    converted: dict[str, Stage] = {}
    for name, stage in stages.items():
        group = _group(str(stage.name))
        body, problems = _stage_body(root, stage)
        issues += [SpecIssue(dvc_file, written.line(_key(str(stage.name), where)), f"stages.{group}.{where}", message)
                   for where, message in problems]
        try:
            converted[name] = Stage.model_validate(body)
        except ValidationError as exc:  # what DVC accepts and a conveyor stage cannot hold
            issues += [SpecIssue(dvc_file, written.line(("stages", group)), f"stages.{group}",
                                 f"{stage.name}: {'.'.join(map(str, err['loc']))}: {err['msg']}")
                       for err in exc.errors()]
    return converted, issues


def by_file(stages: Mapping[str, PipelineStage]) -> dict[Path, dict[str, PipelineStage]]:
    """``stages`` grouped by the dvc.yaml that declares them."""
    found: dict[Path, dict[str, PipelineStage]] = {}
    for name, stage in stages.items():
        found.setdefault(Path(stage.path), {})[name] = stage
    return found


def _key(stage: str, where: str) -> tuple[str, ...]:
    return ("stages", _group(stage), *where.split("."))


def _group(stage: str) -> str:
    """The dvc.yaml key a stage comes from (``train@small`` from ``train``)."""
    return stage.partition("@")[0]


def _stage_body(root: Path, stage: PipelineStage) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A DVC stage as the body of a conveyor cmd stage, and what conveyor cannot honour in it."""
    from dvc.dependency.param import ParamsDependency

    problems: list[tuple[str, str]] = []
    outs: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    for out in stage.outs:
        kind = "metrics" if out.metric else "plots" if out.plot else "outs"
        if not out.is_in_repo:
            problems.append((kind, f"'{out.def_path}' lies outside the repository: conveyor keeps a failed "
                             "stage's outs intact only inside it; write it inside the project"))
            continue
        linked = link_problem(root, rel(root, out.fs_path))
        if linked:  # DVC itself runs the command, writing outside, and only then refuses the out
            problems.append((kind, linked))
            continue
        item = {"path": rel(root, out.fs_path), "persist": bool(out.persist)}
        (metrics if out.metric else outs).append(item)
    deps: list[str] = []
    for dep in stage.deps:
        if isinstance(dep, ParamsDependency):
            continue
        if not dep.is_in_repo:  # a URL, a path outside: DVC checks it, conveyor only passes it on
            deps.append(dep.def_path)
            continue
        deps.append(rel(root, dep.fs_path))
        linked = link_problem(root, deps[-1])
        if linked:
            problems.append(("deps", linked))
    commands = stage.cmd if isinstance(stage.cmd, list) else str(stage.cmd or "").splitlines()
    commands = [c for c in commands if c.strip()]
    if not commands:
        problems.append(("cmd", "a stage without a command: conveyor runs commands (DVC's data sources "
                         "are .dvc files, not stages)"))
        commands = ["true"]
    wdir = rel(root, stage.wdir)
    problems += [("wdir", problem) for problem in [_wdir_problem(root, wdir)] if problem]
    body = {"cmd": commands[0] if len(commands) == 1 else commands, "wdir": None if wdir == "." else wdir,
            "deps": deps, "outs": outs, "metrics": metrics, "desc": stage.desc}
    return body, problems


def _wdir_problem(root: Path, wdir: str) -> str | None:
    """Why a stage's ``wdir`` (relative to the root) cannot be where its command runs, or None."""
    if wdir == ".":
        return None
    if wdir == ".." or wdir.startswith("../"):
        return f"{os.path.normpath(root / wdir)} lies outside the repository ({root}): a command runs inside it"
    if not (root / wdir).is_dir():
        return f"'{wdir}' is not a directory of the project (the stage's command runs in it)"
    return link_problem(root, wdir)


def rel(root: Path, path: str) -> str:
    return Path(os.path.relpath(path, root)).as_posix()




# (params file relative to the root, the keys declared of it; none: the whole file), as a stage's params
Declared = tuple[tuple[str, tuple[str, ...]], ...]


def declared_params(root: Path, stage: PipelineStage) -> Declared:
    """The params ``stage`` declares, file by file, as dvc.lock records them (``params:``)."""
    from dvc.dependency.param import ParamsDependency

    return tuple((rel(root, dep.fs_path), tuple(dep.params)) for dep in stage.deps
                 if isinstance(dep, ParamsDependency))


def params_values(root: Path, declared: Declared, files: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The values of ``declared`` as the files hold them now: a key of the root's params.yaml as it is
    (``train.lr``), one of another file after its path (``sub/params.yaml:lr``), as ``dvc params diff``
    names them. ``files``: what was read already, by path, with the file's stamp then (a file many
    stages declare is read once while it does not change)."""
    import dpath

    values: dict[str, Any] = {}
    for path, keys in declared:
        config = _params_file(root / path, files)
        prefix = "" if path == "params.yaml" else f"{path}:"
        for key in keys or tuple(config):
            try:
                values[prefix + key] = _plain(dpath.get(config, key, separator="."))
            except (KeyError, ValueError):
                continue
    return values


def _params_file(path: Path, files: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """A params file as DVC reads it (YAML, JSON, TOML or Python); empty when missing or broken
    (DVC says so where a stage reads it)."""
    from dvc.exceptions import DvcException
    from dvc.fs import LocalFileSystem
    from dvc.utils.serialize import load_path

    from conveyor.spec.dvcload import stamp

    now = stamp(path)
    if files.get(str(path), (None,))[0] != now or now is None:
        try:
            files[str(path)] = now, load_path(str(path), LocalFileSystem())
        except (OSError, DvcException):
            files[str(path)] = now, {}
    config = files[str(path)][1]
    return config if isinstance(config, dict) else {}


def item_of(stage: PipelineStage) -> dict[str, Any] | None:
    """The foreach/matrix item ``stage`` was made from, as its command reads it (``${item.lr}``:
    ``{"lr": 0.1}``; a matrix's keys; ``${item}`` alone: ``{"item": value}``; with ``${key}`` of a
    foreach over a mapping: ``"key"`` too), or None for a stage of no foreach or matrix."""
    from dvc.parsing import ForeachDefinition, MatrixDefinition

    group, _, key = str(stage.name).partition("@")
    definition = stage.dvcfile.resolver.definitions.get(group) if key else None
    if not isinstance(definition, ForeachDefinition | MatrixDefinition) or key not in definition.normalized_iterable:
        return None
    value = _plain(definition.normalized_iterable[key])
    item = dict(value) if isinstance(value, dict) else {"item": value}
    if isinstance(definition, ForeachDefinition) and isinstance(definition.resolved_iterable, Mapping):
        item = {"key": key, **item}
    return item


def _plain(value: Any) -> Any:
    """A value read by DVC's round-trip YAML as plain JSON types (the run record is JSON)."""
    import json

    return json.loads(json.dumps(value, default=str))
