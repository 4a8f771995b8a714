"""A DVC stage as a conveyor stage: what a run needs of it (command, paths relative to the
project root, wdir, persist, metrics) and what conveyor cannot honour in it, each problem at its
line of the dvc.yaml that declares it.

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



