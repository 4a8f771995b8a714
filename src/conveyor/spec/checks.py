"""Cross-checks of a spec as a whole: what its names refer to, its paths, and its graph.

Each check reads the raw YAML data (so it also runs where the structure is partly invalid)
and returns :class:`SpecIssue` items with the line of the key they are about; the loader
collects them all and raises once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from conveyor.errors import SpecIssue, did_you_mean
from conveyor.plan import dag
from conveyor.spec.interpolate import dotted_keys
from conveyor.spec.models import Stage
from conveyor.spec.sources import package_problem, task_problem
from conveyor.spec.yamlmap import Key, LoadedYaml

PATH_FIELDS = ("deps", "outs", "metrics")
INTERNAL = {".git": "git", ".dvc": "DVC", ".conveyor": "conveyor"}  # directories no stage reads or writes


def stages_of(raw: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The stages of raw spec data that are mappings, by name."""
    stages = raw.get("stages")
    if isinstance(stages, dict):
        for name, body in stages.items():
            if isinstance(body, dict):
                yield str(name), body


def strings(body: Mapping[str, Any], key: str) -> Iterator[tuple[int, str]]:
    """The string items of the list at ``body[key]``, with their index."""
    values = body.get(key)
    if isinstance(values, list):
        for i, value in enumerate(values):
            if isinstance(value, str):
                yield i, value


def declared_paths(body: Mapping[str, Any], kind: str) -> Iterator[tuple[int | str, str]]:
    """The paths at ``body[kind]`` in any of their forms, each with its key (index or name)."""
    values = body.get(kind)
    if isinstance(values, list):
        for i, value in enumerate(values):
            if isinstance(value, str):
                yield i, value
            elif isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value)), str):
                yield i, next(iter(value))
    elif isinstance(values, dict):
        for name, value in values.items():
            path = value.get("path") if isinstance(value, dict) else value
            if isinstance(path, str):
                yield str(name), path


def valid_stages(raw: Mapping[str, Any]) -> dict[str, Stage]:
    """Every stage's graph fields, so graph checks run even where other fields are invalid."""
    stages: dict[str, Stage] = {}
    for name, body in stages_of(raw):
        try:
            stages[name] = Stage.model_validate(body)
        except ValidationError:
            fields: dict[str, Any] = {f: [p for _, p in declared_paths(body, f)] for f in PATH_FIELDS}
            fields["needs"] = [v for _, v in strings(body, "needs")]
            try:
                stages[name] = Stage.model_validate({"task": "invalid:stage", **fields})
            except ValidationError:
                continue
    return stages


CLUSTER_KINDS = frozenset({"dask", "dask-cuda", "slurm"})  # profiles whose tasks compute on Dask workers


def check_references(doc: LoadedYaml, raw: Mapping[str, Any], params: Mapping[str, Any],
                     root: Path) -> list[SpecIssue]:
    """Names that must refer to something: profiles, stages, params keys, tasks, paths."""
    profiles = raw.get("profiles") if isinstance(raw.get("profiles"), dict) else {}
    assert isinstance(profiles, dict)
    declared = raw.get("task_packages")
    packages = [str(p) for p in declared] if isinstance(declared, list) else ["tasks"]
    context = _References(doc, [name for name, _ in stages_of(raw)], list(dotted_keys(params)), profiles,
                       str(raw.get("params") or "params.yaml"), root, packages)
    for i, package in enumerate(declared if isinstance(declared, list) else []):
        problem = package_problem(str(package))
        if problem:
            context.issue(("task_packages", i), problem)
    for name, body in stages_of(raw):
        context.check_stage(name, body)
    for pname, body in profiles.items():
        context.check_fallback(pname, body)
    if isinstance(raw.get("model"), dict):
        context.check_model(raw["model"], raw)
    return context.issues


class _References:
    """What the reference checks of one spec share, and the issues they found."""

    def __init__(self, doc: LoadedYaml, stages: list[str], param_keys: list[str], profiles: dict[str, Any],
                 params_file: str, root: Path, packages: list[str]) -> None:
        self.doc, self.stages, self.param_keys, self.profiles = doc, stages, param_keys, profiles
        self.params_file, self.root, self.packages = params_file, root, packages
        self.issues: list[SpecIssue] = []

    @property
    def needable(self) -> list[str]:
        """What ``needs`` may name: a stage, or a matrix by its name (``train``: every ``train@...``)."""
        return list(dict.fromkeys([*(s.partition("@")[0] for s in self.stages), *self.stages]))

    def issue(self, key: Key, message: str) -> None:
        self.issues.append(SpecIssue(self.doc.path, self.doc.line(key), ".".join(map(str, key)), message))

    def check_stage(self, name: str, body: dict[str, Any]) -> None:
        on = body.get("on")
        if isinstance(on, str) and on not in self.profiles:
            hint = did_you_mean(on, self.profiles) or f"; profiles: {', '.join(self.profiles) or 'none declared'}"
            self.issue(("stages", name, "on"), f"unknown profile '{on}'{hint}")
        for i, need in strings(body, "needs"):
            if need not in self.stages:
                self.issue(("stages", name, "needs", i), f"unknown stage '{need}'{did_you_mean(need, self.needable)}")
            elif need == name:
                self.issue(("stages", name, "needs", i), "a stage cannot need itself")
        for i, param in strings(body, "params"):
            if self.param_keys and param not in self.param_keys:
                self.issue(("stages", name, "params", i), f"unknown param key '{param}' in "
                           f"{self.params_file}{did_you_mean(param, self.param_keys)}")
        for kind in PATH_FIELDS:
            for key, path in declared_paths(body, kind):
                problem = path_problem(path) or link_problem(self.root, path)
                if problem:
                    self.issue(("stages", name, kind, key), problem)
        self._check_runs(name, body)

    def _check_runs(self, name: str, body: dict[str, Any]) -> None:
        """What the stage runs: a task of the project's packages, or a cmd in an existing wdir."""
        task = body.get("task")
        on = body.get("on")
        profile = self.profiles.get(on) if isinstance(on, str) else None
        if body.get("deterministic") is True and task is not None and isinstance(profile, dict) \
                and profile.get("kind") in CLUSTER_KINDS:
            self.issue(("stages", name, "deterministic"),
                       f"a deterministic task runs in a process of its own, started with pinned kernel paths; "
                       f"the Dask workers of profile '{body['on']}' were started without them: run it without "
                       f"'on:' (or on a threads profile), or make it a cmd, which gets them on a worker too")
        if body.get("resources") and not (isinstance(profile, dict) and profile.get("kind") in CLUSTER_KINDS):
            where = f"profile '{on}' runs no Dask workers" if isinstance(on, str) else "it has no 'on:'"
            self.issue(("stages", name, "resources"),
                       f"resources are held on Dask workers and {where}: put the stage on a dask, dask-cuda "
                       "or slurm profile (on:), or remove resources")
        if isinstance(task, str) and ":" in task:
            problem = task_problem(self.root, task, self.packages)
            if problem:
                self.issue(("stages", name, "task"), problem)
        wdir = body.get("wdir")
        if isinstance(wdir, str) and body.get("cmd") is not None:
            problem = path_problem(wdir) or link_problem(self.root, wdir)
            if problem is None and not (self.root / wdir).is_dir():
                problem = f"'{wdir}' is not a directory of the project (a cmd runs in it)"
            if problem:
                self.issue(("stages", name, "wdir"), problem)

    def check_model(self, body: dict[str, Any], raw: Mapping[str, Any]) -> None:
        """The model's files are outs of stages (a model is what the pipeline makes), its
        functions are the project's."""
        written = [path for _, stage in stages_of(raw) for kind in ("outs", "metrics")
                   for _, path in declared_paths(stage, kind)]
        files = body.get("files")
        for name, path in (files.items() if isinstance(files, dict) else []):
            if not isinstance(path, str):
                continue
            problem = path_problem(path)
            if problem is None and not any(path == w or path.startswith(w.rstrip("/") + "/") for w in written):
                problem = f"'{path}' is not written by any stage (an out, or a file in one): a model is what " \
                          "the pipeline makes"
            if problem:
                self.issue(("model", "files", name), problem)
        for key in ("predict", "load"):
            ref = body.get(key)
            if isinstance(ref, str) and ":" in ref:
                problem = task_problem(self.root, ref, self.packages)
                if problem:
                    self.issue(("model", key), problem.replace("task '", "function '"))

    def check_fallback(self, pname: str, body: Any) -> None:
        fallback = body.get("fallback") if isinstance(body, dict) else None
        if isinstance(fallback, str) and fallback not in ("error", "cpu", *self.profiles):
            self.issue(("profiles", pname, "fallback"), f"unknown fallback '{fallback}': use error, cpu "
                       f"or a profile name{did_you_mean(fallback, self.profiles)}")
        elif isinstance(fallback, str) and fallback in self.profiles:
            target = self.profiles[fallback]
            if isinstance(target, dict) and target.get("kind") == "dask-cuda":
                self.issue(("profiles", pname, "fallback"), f"fallback '{fallback}' is itself a GPU profile")


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a project path (URL, absolute, leaving the project), or None."""
    if "://" in path:
        return f"'{path}' is a URL: deps and outs are project paths; put URLs in params"
    pure = PurePosixPath(path)
    if pure.is_absolute() or path.startswith("~"):
        return f"'{path}' is absolute: paths are relative to the project root"
    if ".." in pure.parts:
        return f"'{path}' leaves the project: paths must stay inside the project root"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return f"{path!r} holds a control character: name files with printable characters"
    if pure.parts and pure.parts[0] in INTERNAL:
        return f"'{path}' is inside {pure.parts[0]}/, which belongs to {INTERNAL[pure.parts[0]]}, not to stages"
    if not path.strip() or path.strip() in (".", "./"):
        return f"'{path}' is the whole project: name a file or directory in it"
    return None


def link_problem(root: Path, path: str) -> str | None:
    """Why ``path`` leaves the project through a symbolic link on the way to it, or None.

    A link to a directory outside (``data/r/link -> /elsewhere``) would have a stage write
    outside the project; a link at the end of the path to a file (DVC's cache links, with
    ``cache.type: symlink``) is read, or replaced when the stage writes, so it may point anywhere.
    """
    here = root
    parts = PurePosixPath(path).parts
    for n, part in enumerate(parts, start=1):
        here = here / part
        if not here.is_symlink():
            if not here.exists():
                return None  # nothing more on disk to follow
            continue
        target = here.resolve()  # the root resolved only here: most paths have no link (5,000 stages: 0.5 s)
        if (n < len(parts) or target.is_dir()) and not target.is_relative_to(root.resolve()):
            link = PurePosixPath(*parts[:n]).as_posix()
            return (f"'{path}' leaves the project through the symbolic link '{link}' -> '{os.readlink(here)}': "
                    "paths must stay inside the project root")
    return None


def check_graph(doc: LoadedYaml, stages: Mapping[str, Stage], graph: dag.Graph, root: Path, *,
                bad_paths: set[str]) -> list[SpecIssue]:
    """Cycles, outs claimed twice, and deps nobody produces that are not on disk.

    ``bad_paths`` are keys already reported (a URL, a path leaving the project): a dep
    there is not also reported as missing.
    """
    issues: list[SpecIssue] = []
    cycle = dag.find_cycle(graph)
    if cycle:
        issues.append(SpecIssue(doc.path, doc.line(("stages", cycle[0])), f"stages.{cycle[0]}",
                                f"cycle: {' -> '.join(cycle)}"))
    owners: list[tuple[str, Key, str]] = []  # (stage, key of the path, path)
    for name, stage in stages.items():
        for kind, items in (("outs", stage.out_items), ("metrics", stage.metric_items)):
            owners += [(name, ("stages", name, kind, item.name or i), item.path) for i, item in enumerate(items)]
    produced = dag.PathIndex()
    for stage_name, key, path in owners:  # each path against those before it, as they were declared
        for n in sorted(produced.keys(path)):
            other, (_, _, other_path) = produced.owners[n], owners[n]
            issues.append(SpecIssue(doc.path, doc.line(key), ".".join(map(str, key[:3])),
                                    f"'{path}' is also written by stage '{other}' ('{other_path}'): "
                                    "every out has one producer"))
        produced.add(path, stage_name)
    for name, stage in stages.items():
        for i, item in enumerate(stage.dep_items):
            key = ("stages", name, "deps", item.name or i)
            if ".".join(map(str, key)) in bad_paths:
                continue
            if not produced.keys(item.path) and not (root / item.path).exists():
                issues.append(SpecIssue(doc.path, doc.line(key), f"stages.{name}.deps",
                                        f"'{item.path}' does not exist and no stage writes it"))
    return issues
