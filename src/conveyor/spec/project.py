"""A loaded project: the spec, its params, its graph, checked as a whole.

``load_project`` is the one entry point: it reads the YAML (with line numbers), replaces
``${...}`` from the params file, checks structure, references, paths, tasks and the graph,
and raises one :class:`SpecError` listing every problem. It imports no task: tasks are
found on disk and their source parsed with ``ast``, so ``conveyor validate`` stays fast.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from conveyor.errors import SpecError, SpecIssue, UsageError, did_you_mean
from conveyor.plan import dag
from conveyor.spec.checks import check_graph, check_references, link_problem, path_problem, stages_of, valid_stages
from conveyor.spec.dvcyaml import DvcSource, is_placement, load_dvc_project
from conveyor.spec.interpolate import interpolate_stage, lookup
from conveyor.spec.matrix import Expanded, expand, group_key, of_item
from conveyor.spec.models import Pipeline
from conveyor.spec.parse import parse_pipeline
from conveyor.spec.sources import local_sources
from conveyor.spec.yamlmap import LoadedYaml, load_yaml, yaml_issue

DEFAULT_SPEC = Path("configs/pipeline.yaml")
DVC_FILE = "dvc.yaml"
ROOT_MARKERS = ("pyproject.toml", "dvc.yaml")

__all__ = ["Place", "Project", "find_root", "load_project", "locate", "lookup", "resolve_spec"]


@dataclass(frozen=True)
class Place:
    """Where a spec lives: its project's root and the spec's path."""

    root: Path
    spec_path: Path

    @property
    def spec_option(self) -> str:
        """`` -c SPEC`` for a command line naming this project's spec; empty for the default one."""
        try:
            default = resolve_spec(None, self.root)
        except UsageError:
            default = None
        return "" if self.spec_path == default else f" -c {self.rel(self.spec_path)}"

    def rel(self, path: Path) -> str:
        """``path`` relative to the root, or absolute when it lies outside (a spec given with -c)."""
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)


@dataclass(frozen=True)
class Project(Place):
    """A valid spec with everything the planner and runner need to know about it.

    ``pipeline`` is the spec with ``${...}`` replaced (what runs); ``declared`` is the spec
    as written (what ``conveyor compile`` writes into dvc.yaml, for DVC to interpolate).
    ``dvc`` is set when the stages come from an existing dvc.yaml (SPEC.md §2.3).
    """

    pipeline: Pipeline
    params_path: Path
    params: Mapping[str, Any]
    graph: Mapping[str, frozenset[str]]
    declared: Pipeline | None = None
    dvc: DvcSource | None = None
    matrix: Expanded | None = None  # the matrix stages of the spec and the items they made
    # Task sources, found once per stage: stages check their fingerprint in parallel threads,
    # and CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth mismatch").
    _sources: dict[str, list[Path]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _sources_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                          compare=False)

    @property
    def order(self) -> list[str]:
        return dag.topological_order(self.graph, self.pipeline.stages)

    @property
    def as_written(self) -> Pipeline:
        return self.declared or self.pipeline

    @property
    def frozen(self) -> frozenset[str]:
        """Stages whose command never runs (DVC's ``frozen: true``): their outs are only checked."""
        return self.dvc.frozen if self.dvc is not None else frozenset()

    def metrics_of(self, stage: str) -> tuple[str, ...]:
        """The metrics files ``stage`` writes (for a dvc.yaml, also the top-level ones in its outs)."""
        if self.dvc is not None and self.dvc.metrics is not None:
            return tuple(self.dvc.metrics.get(stage, ()))
        return self.pipeline.stages[stage].metrics

    def item_of(self, stage: str) -> dict[str, Any] | None:
        """The matrix item of ``stage`` (``{"eta": 0.1, "max_depth": 6}`` for ``train@0.1-6``), or None."""
        if self.dvc is not None:  # a foreach or matrix item of a dvc.yaml
            found = self.dvc.items.get(stage)
            return dict(found) if found is not None else None
        item = self.matrix.items.get(stage) if self.matrix is not None else None
        return dict(item) if item is not None else None

    def expand(self, names: Sequence[str], *, glob: bool = False) -> list[str]:
        """Stage names as a command line gives them: a stage, or a matrix/foreach group
        (``train`` for every ``train@...``, as ``dvc repro train``), or with ``glob`` a shell-style
        pattern (``train@*``, as ``dvc repro --glob``); a UsageError names any unknown one."""
        stages: list[str] = []
        unknown: list[str] = []
        for name in map(self._own_address, names):
            found = [name] if name in self.pipeline.stages else \
                fnmatch.filter(self.order, name) if glob and any(c in name for c in "*?[") else \
                [s for s in self.order if s.startswith(f"{name}@")]
            stages += found
            if not found:
                unknown.append(name)
        if unknown:
            hints = "".join(did_you_mean(s, self.pipeline.stages) for s in unknown)
            raise UsageError(f"unknown stage(s): {', '.join(unknown)}{hints}; stages: {', '.join(self.order)}"
                             + self._elsewhere(unknown))
        return list(dict.fromkeys(stages))

    def _own_address(self, name: str) -> str:
        """A stage of the dvc.yaml run, addressed as ``dvc repro`` also takes it (``dvc.yaml:train``,
        ``:train``, the file relative to the working directory or the root), by its name alone."""
        file, sep, stage = name.rpartition(":")
        if self.dvc is None or not sep or not stage:
            return name
        own = self.dvc.file.resolve()
        return stage if not file or own in ((Path.cwd() / file).resolve(), (self.root / file).resolve()) else name

    def _elsewhere(self, unknown: Sequence[str]) -> str:
        """For a stage of another dvc.yaml (``sub/dvc.yaml:lonely``) upstream of none of this one's
        (so not part of its run): how to run it from its own file, as ``dvc repro`` would run it."""
        for name in unknown:
            file, _, stage = name.rpartition(":")
            if self.dvc is not None and file and stage and (self.root / file).is_file():
                return (f"; this runs {self.rel(self.dvc.file)} and, of other dvc.yaml files, only the stages "
                        f"upstream of it: run that one with `conveyor run -c {file} {stage}`")
        return ""

    def stage_params(self, stage: str) -> dict[str, Any]:
        """The declared params of ``stage``: dotted key -> value (for a dvc.yaml's stage, a key of
        another file than params.yaml after its path: ``sub/params.yaml:lr``)."""
        if self.dvc is not None:
            return self.dvc.params_of(self.root, stage)
        return {key: lookup(self.params, key) for key in self.pipeline.stages[stage].params}

    def task_sources(self, stage: str) -> list[Path]:
        """The source files of a stage's task: its module and the project modules it imports (none for a cmd)."""
        spec = self.pipeline.stages[stage]
        if not spec.task:
            return []
        with self._sources_lock:  # per module: stages sharing a task module parse it once
            if spec.module not in self._sources:
                self._sources[spec.module] = sorted(local_sources(self.root, spec.module, self.pipeline.task_packages))
            return list(self._sources[spec.module])


def find_root(start: Path) -> Path:
    """The nearest directory at or above ``start`` holding pyproject.toml or dvc.yaml."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    raise UsageError(f"no project found at or above {start}: conveyor looks for "
                     f"{' or '.join(ROOT_MARKERS)}; run it inside a project or pass -c")


def resolve_spec(spec: Path | None, cwd: Path | None = None) -> Path:
    """``-c`` as given, else configs/pipeline.yaml under the project root, else its dvc.yaml."""
    cwd = cwd or Path.cwd()
    if spec is None:
        root = find_root(cwd)
        found = [p for p in (root / DEFAULT_SPEC, root / DVC_FILE) if p.is_file()]
        if not found:
            raise UsageError(f"no pipeline in {root}: neither {DEFAULT_SPEC} nor {DVC_FILE} is there "
                             "(pass -c FILE, or make one with `conveyor init`)")
        return found[0].resolve()
    path = cwd / spec
    if path.is_dir():
        raise UsageError(f"spec file {path} is a directory (pass -c FILE: a spec or a dvc.yaml)")
    if not path.is_file():
        raise UsageError(f"spec file {path} not found (pass -c FILE)")
    return path.resolve()


def locate(spec_path: Path) -> tuple[Place, str]:
    """The place of ``spec_path`` and its pipeline's name, as :func:`load_project` finds them,
    without loading its stages: what reading past run records needs (``conveyor runs`` and
    ``compare``), where loading a 5,000-stage dvc.yaml through DVC takes seconds. A spec whose
    place is not plain to see (not in a DVC repository, no name) is loaded, and its errors raised."""
    spec_path = spec_path.resolve()
    found = _plain_place(spec_path)
    if found is not None:
        return found
    project = load_project(spec_path)
    return project, project.pipeline.pipeline


def _plain_place(spec_path: Path) -> tuple[Place, str] | None:
    try:
        written = None if spec_path.name == DVC_FILE else _load(spec_path)
        root = find_root(spec_path.parent)
    except (SpecError, UsageError):
        return None
    data = written.data if written is not None and isinstance(written.data, dict) else {}
    name = data.get("pipeline")
    if written is None or is_placement(written):  # the root is the DVC repository's, as DVC finds it
        from dvc.exceptions import NotDvcRepoError
        from dvc.repo import Repo

        target = spec_path if written is None else spec_path.parent / str(data["dvc"])
        if not target.is_file():  # the dvc.yaml at the root instead: loading finds it
            return None
        try:
            root = Path(Repo.find_root(str(target.parent)))
        except NotDvcRepoError:
            return None
        name = name or root.name
    return (Place(root, spec_path), name) if isinstance(name, str) and name else None


def load_project(spec_path: Path, cwd: Path | None = None, *, params_text: str | None = None,
                 all_pipelines: bool = False) -> Project:
    """Load and check ``spec_path``; raises SpecError with every problem found.

    The project is the one the spec lives in, else the one of ``cwd`` (a spec kept elsewhere).
    ``params_text``: what the params file would hold (``-S`` values set), read instead of the
    file, so a project is checked, planned and expanded with them before anything is written.
    ``all_pipelines``: a dvc.yaml's project holds every stage of every dvc.yaml of the repository
    (``dvc repro -P``), not only the file's and those upstream of them.
    """
    spec_path = spec_path.resolve()
    if spec_path.name == DVC_FILE:
        return load_dvc_project(spec_path, all_pipelines=all_pipelines)
    try:
        root = find_root(spec_path.parent)
    except UsageError:
        root = find_root(cwd or Path.cwd())
    written = _load(spec_path)
    if is_placement(written):
        target = written.data.get("dvc")
        if not isinstance(target, str) or Path(target).name != DVC_FILE:
            raise SpecError([SpecIssue(spec_path, written.line(("dvc",)), "dvc",
                                       f"names the dvc.yaml whose stages this spec places (got {target!r})")])
        dvc_file = spec_path.parent / target
        if not dvc_file.is_file():
            dvc_file = root / target
        if not dvc_file.is_file():
            raise SpecError([SpecIssue(spec_path, written.line(("dvc",)), "dvc",
                                       f"{target} not found next to the spec or at the project root ({root})")])
        return load_dvc_project(dvc_file.resolve(), written, all_pipelines=all_pipelines)
    raw = written.data if isinstance(written.data, dict) else {}
    params_path, params, issues = _params_of(root, written, raw, params_text)
    matrix = expand(written, params)
    issues += matrix.issues
    doc, interpolation_issues = _interpolated(matrix.doc, params, matrix.items)
    issues += interpolation_issues
    raw = doc.data if isinstance(doc.data, dict) else {}
    try:
        pipeline: Pipeline | None = parse_pipeline(doc, matrix.items)
    except SpecError as exc:
        issues += exc.issues
        pipeline = None
    issues += check_references(doc, raw, params, root)
    issues += [SpecIssue(doc.path, line, ".".join(map(str, key)), "defined twice: the second one would "
                         "silently replace the first") for key, line in doc.duplicates]
    stages = pipeline.stages if pipeline is not None else valid_stages(raw)
    graph = dag.stage_graph(stages)
    issues += check_graph(doc, stages, graph, root, bad_paths={i.key for i in issues})
    if issues or pipeline is None:
        if matrix.groups:  # what every item of a matrix repeats is said once, of the matrix stage
            issues = list(dict.fromkeys(replace(i, key=group_key(i.key, matrix.items)) for i in issues))
        raise SpecError(sorted(issues, key=lambda i: (str(i.file), i.line or 0)))
    declared = parse_pipeline(matrix.doc, matrix.items) if doc is not written else None
    return Project(root, spec_path, pipeline, params_path, params, graph, declared,
                   matrix=matrix if matrix.groups else None)


def _interpolated(doc: LoadedYaml, params: Mapping[str, Any],
                  items: Mapping[str, Any]) -> tuple[LoadedYaml, list[SpecIssue]]:
    """``doc`` with ``${...}`` replaced in every stage (the same object when there is none).

    ``items``: stages a matrix made, whose ``${item...}`` the matrix filled in (or reported).
    """
    raw = doc.data if isinstance(doc.data, dict) else {}
    stages: dict[str, Any] = {}
    issues: list[SpecIssue] = []
    for name, body in stages_of(raw):
        stages[name], problems = interpolate_stage(body, params, (lambda k: not of_item(k)) if name in items else None)
        for where, message in problems:
            key = ("stages", name, *where)
            issues.append(SpecIssue(doc.path, doc.line(key), ".".join(map(str, key)), message))
    if all(stages[name] == body for name, body in stages_of(raw)):
        return doc, issues
    data = {**raw, "stages": {**raw["stages"], **stages}}
    return LoadedYaml(doc.path, data, doc.lines, doc.duplicates), issues


def _load(path: Path, text: str | None = None) -> LoadedYaml:
    try:
        return load_yaml(path, text)
    except yaml.YAMLError as exc:
        raise SpecError([yaml_issue(path, exc)]) from None


def _params_of(root: Path, doc: LoadedYaml, raw: Mapping[str, Any],
               text: str | None = None) -> tuple[Path, dict[str, Any], list[SpecIssue]]:
    """The spec's params file, its data (of ``text`` when given), and the problems found; a path
    leaving the project is never read."""
    name = raw.get("params")
    name = name if isinstance(name, str) and name else "params.yaml"
    problem = path_problem(name) or link_problem(root, name)
    if problem:
        return root / name, {}, [SpecIssue(doc.path, doc.line(("params",)), "params", problem)]
    return root / name, *_load_params(root / name, doc, raw, text)


def _load_params(path: Path, doc: LoadedYaml, raw: Mapping[str, Any],
                 text: str | None) -> tuple[dict[str, Any], list[SpecIssue]]:
    declares = any(body.get("params") for _, body in stages_of(raw))
    if text is not None:
        return _params_data(path, text)
    if not path.exists():
        if declares:
            return {}, [SpecIssue(doc.path, doc.line(("params",)), "params",
                                  f"params file {path} not found; create it or fix 'params:'")]
        return {}, []
    if path.is_dir():
        return {}, [SpecIssue(doc.path, doc.line(("params",)), "params",
                              f"{path} is a directory: name the params file (a YAML mapping) in it")]
    return _params_data(path, None)


def _params_data(path: Path, text: str | None) -> tuple[dict[str, Any], list[SpecIssue]]:
    try:
        data = _load(path, text).data
    except SpecError as exc:
        return {}, exc.issues
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [SpecIssue(path, 1, "", "a params file is a mapping of keys to values")]
    return data, []


def ensure_importable(root: Path) -> None:
    """Put the project root first on ``sys.path`` so its task packages import."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
