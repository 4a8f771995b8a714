"""A loaded project: the spec, its params, its graph, checked as a whole.

``load_project`` is the one entry point: it reads the YAML (with line numbers), checks
structure, references, paths, tasks and the graph, and raises one :class:`SpecError`
listing every problem. It imports no task: tasks are found on disk and their source
parsed with ``ast``, so ``conveyor validate`` stays fast.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from conveyor.errors import SpecError, SpecIssue, UsageError
from conveyor.plan import dag
from conveyor.spec.models import Pipeline, Stage, did_you_mean, parse_pipeline
from conveyor.spec.yamlmap import Key, LoadedYaml, load_yaml

DEFAULT_SPEC = Path("configs/pipeline.yaml")
ROOT_MARKERS = ("pyproject.toml", "dvc.yaml")


@dataclass(frozen=True)
class Project:
    """A valid spec with everything the planner and runner need to know about it."""

    root: Path
    spec_path: Path
    pipeline: Pipeline
    params_path: Path
    params: Mapping[str, Any]
    graph: Mapping[str, frozenset[str]]
    # Task sources, found once per stage: stages check their fingerprint in parallel threads,
    # and CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth mismatch").
    _sources: dict[str, list[Path]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _sources_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                          compare=False)

    @property
    def order(self) -> list[str]:
        return dag.topological_order(self.graph, self.pipeline.stages)

    def stage_params(self, stage: str) -> dict[str, Any]:
        """The declared params of ``stage``: dotted key -> value."""
        return {key: lookup(self.params, key) for key in self.pipeline.stages[stage].params}

    def task_sources(self, stage: str) -> list[Path]:
        """The source files of a stage's task: its module and the project modules it imports."""
        with self._sources_lock:
            if stage not in self._sources:
                spec = self.pipeline.stages[stage]
                self._sources[stage] = sorted(_local_sources(self.root, spec.module, self.pipeline.task_packages))
            return list(self._sources[stage])

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def find_root(start: Path) -> Path:
    """The nearest directory at or above ``start`` holding pyproject.toml or dvc.yaml."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    raise UsageError(f"no project found at or above {start}: conveyor looks for "
                     f"{' or '.join(ROOT_MARKERS)}; run it inside a project or pass -c")


def resolve_spec(spec: Path | None, cwd: Path | None = None) -> Path:
    """``-c`` as given, else configs/pipeline.yaml under the project root."""
    cwd = cwd or Path.cwd()
    path = (cwd / spec) if spec is not None else find_root(cwd) / DEFAULT_SPEC
    if not path.is_file():
        raise UsageError(f"spec file {path} not found (pass -c FILE)")
    return path.resolve()


def load_project(spec_path: Path) -> Project:
    """Load and check ``spec_path``; raises SpecError with every problem found."""
    spec_path = spec_path.resolve()
    root = find_root(spec_path.parent)
    doc = _load(spec_path)
    issues: list[SpecIssue] = []
    try:
        pipeline: Pipeline | None = parse_pipeline(doc)
    except SpecError as exc:
        issues += exc.issues
        pipeline = None
    raw = doc.data if isinstance(doc.data, dict) else {}
    params_path = root / str(raw.get("params") or "params.yaml")
    params, params_issues = _load_params(params_path, doc, raw)
    issues += params_issues
    issues += _check_references(doc, raw, params, root)
    issues += [SpecIssue(doc.path, line, ".".join(map(str, key)), "defined twice: the second one would "
                         "silently replace the first") for key, line in doc.duplicates]
    stages = pipeline.stages if pipeline is not None else _valid_stages(raw)
    graph = dag.stage_graph(stages)
    issues += _check_graph(doc, stages, graph, root, bad_paths={i.key for i in issues})
    if issues or pipeline is None:
        raise SpecError(sorted(issues, key=lambda i: (str(i.file), i.line or 0)))
    return Project(root, spec_path, pipeline, params_path, params, graph)


GRAPH_FIELDS = ("needs", "deps", "outs", "metrics")


def _valid_stages(raw: dict[str, Any]) -> dict[str, Stage]:
    """Every stage's graph fields, so graph checks run even where other fields are invalid."""
    stages: dict[str, Stage] = {}
    for name, body in _stages(raw):
        try:
            stages[name] = Stage.model_validate(body)
        except ValidationError:
            fields = {f: tuple(v for _, v in _strings(body, f)) for f in GRAPH_FIELDS}
            try:
                stages[name] = Stage.model_validate({"task": "invalid:stage", **fields})
            except ValidationError:
                continue
    return stages


def lookup(params: Mapping[str, Any], dotted: str) -> Any:
    """``params["train"]["xgb"]`` for ``"train.xgb"``; KeyError when absent."""
    value: Any = params
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _load(path: Path) -> LoadedYaml:
    try:
        return load_yaml(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([SpecIssue(path, line, "", f"not valid YAML: {problem}")]) from None


def _load_params(path: Path, doc: LoadedYaml, raw: dict[str, Any]) -> tuple[dict[str, Any], list[SpecIssue]]:
    declares = any(isinstance(s, dict) and s.get("params") for s in (raw.get("stages") or {}).values())
    if not path.exists():
        if declares:
            return {}, [SpecIssue(doc.path, doc.line(("params",)), "params",
                                  f"params file {path} not found; create it or fix 'params:'")]
        return {}, []
    try:
        data = _load(path).data
    except SpecError as exc:
        return {}, exc.issues
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [SpecIssue(path, 1, "", "a params file is a mapping of keys to values")]
    return data, []


def _dotted_keys(params: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        yield dotted
        if isinstance(value, Mapping):
            yield from _dotted_keys(value, dotted + ".")


def _stages(raw: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    stages = raw.get("stages")
    if isinstance(stages, dict):
        for name, body in stages.items():
            if isinstance(body, dict):
                yield str(name), body


def _strings(body: dict[str, Any], key: str) -> Iterator[tuple[int, str]]:
    values = body.get(key)
    if isinstance(values, list):
        for i, value in enumerate(values):
            if isinstance(value, str):
                yield i, value


def _check_references(doc: LoadedYaml, raw: dict[str, Any], params: Mapping[str, Any],
                      root: Path) -> list[SpecIssue]:
    """Names that must refer to something: profiles, stages, params keys, tasks, paths."""
    profiles = raw.get("profiles") if isinstance(raw.get("profiles"), dict) else {}
    assert isinstance(profiles, dict)
    stage_names = [name for name, _ in _stages(raw)]
    param_keys = list(_dotted_keys(params))
    declared = raw.get("task_packages")
    packages: list[Any] = declared if isinstance(declared, list) else ["tasks"]
    issues: list[SpecIssue] = []

    def issue(key: Key, message: str) -> None:
        issues.append(SpecIssue(doc.path, doc.line(key), ".".join(map(str, key)), message))

    for name, body in _stages(raw):
        on = body.get("on")
        if isinstance(on, str) and on not in profiles:
            hint = did_you_mean(on, profiles) or f"; profiles: {', '.join(profiles) or 'none declared'}"
            issue(("stages", name, "on"), f"unknown profile '{on}'{hint}")
        for i, need in _strings(body, "needs"):
            if need not in stage_names:
                issue(("stages", name, "needs", i), f"unknown stage '{need}'{did_you_mean(need, stage_names)}")
            elif need == name:
                issue(("stages", name, "needs", i), "a stage cannot need itself")
        for i, key in _strings(body, "params"):
            if params and key not in param_keys:
                issue(("stages", name, "params", i), f"unknown param key '{key}' in "
                      f"{raw.get('params') or 'params.yaml'}{did_you_mean(key, param_keys)}")
        for kind in ("deps", "outs", "metrics"):
            for i, path in _strings(body, kind):
                problem = _path_problem(path)
                if problem:
                    issue(("stages", name, kind, i), problem)
        task = body.get("task")
        if isinstance(task, str) and ":" in task:
            problem = _task_problem(root, task, [str(p) for p in packages])
            if problem:
                issue(("stages", name, "task"), problem)
    for pname, body in profiles.items():
        fallback = body.get("fallback") if isinstance(body, dict) else None
        if isinstance(fallback, str) and fallback not in ("error", "cpu", *profiles):
            issue(("profiles", pname, "fallback"), f"unknown fallback '{fallback}': use error, cpu "
                  f"or a profile name{did_you_mean(fallback, profiles)}")
        elif isinstance(fallback, str) and fallback in profiles:
            target = profiles[fallback]
            if isinstance(target, dict) and target.get("kind") == "dask-cuda":
                issue(("profiles", pname, "fallback"), f"fallback '{fallback}' is itself a GPU profile")
    return issues


def _path_problem(path: str) -> str | None:
    if "://" in path:
        return f"'{path}' is a URL: deps and outs are project paths; put URLs in params"
    pure = PurePosixPath(path)
    if pure.is_absolute() or path.startswith("~"):
        return f"'{path}' is absolute: paths are relative to the project root"
    if ".." in pure.parts:
        return f"'{path}' leaves the project: paths must stay inside the project root"
    if not path.strip() or path.strip() in (".", "./"):
        return f"'{path}' is the whole project: name a file or directory in it"
    return None


def _module_file(root: Path, module: str) -> Path | None:
    """The file of ``module``, looked up under the project root first, without importing it."""
    parts = module.split(".")
    if (root / parts[0]).is_dir():  # the project's own package: only its files count
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None
    # An installed package: walk the import path finder, which reads directories, not modules.
    locations: list[str] | None = None
    spec = None
    for n in range(1, len(parts) + 1):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:n]), locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    return Path(spec.origin) if spec is not None and spec.origin else None


def _task_problem(root: Path, task: str, packages: list[str]) -> str | None:
    module, _, function = task.partition(":")
    if not any(module == p or module.startswith(p + ".") for p in packages):
        return f"task '{task}' is outside task_packages ({', '.join(packages)}); move it or add its package"
    path = _module_file(root, module)
    if path is None:
        return f"unknown task '{task}': module '{module}' not found under {root}"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defined = sorted(_top_level_names(tree))
    if function not in defined:
        return f"unknown task '{task}': no function '{function}' in {path.name}{did_you_mean(function, defined)}"
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines or imports at top level: where a task function can come from."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _local_sources(root: Path, module: str, packages: tuple[str, ...]) -> set[Path]:
    """The module's file and, transitively, every module of ``packages`` it imports."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_file(root, name)
        if path is None or path in seen:
            continue
        seen.add(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else (node.module or "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            todo += [n for n in names if any(n == p or n.startswith(p + ".") for p in packages)]
    return seen


def _check_graph(doc: LoadedYaml, stages: Mapping[str, Stage], graph: dag.Graph, root: Path, *,
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
    owners: list[tuple[str, int, str, str]] = []  # (stage, index, field, path)
    for name, stage in stages.items():
        owners += [(name, i, "outs", p) for i, p in enumerate(stage.outs)]
        owners += [(name, i, "metrics", p) for i, p in enumerate(stage.metrics)]
    for n, (writer, i, kind, path) in enumerate(owners):
        for other, _, _, other_path in owners[:n]:
            if dag.overlaps(path, other_path):
                issues.append(SpecIssue(doc.path, doc.line(("stages", writer, kind, i)),
                                        f"stages.{writer}.{kind}",
                                        f"'{path}' is also written by stage '{other}' ('{other_path}'): "
                                        "every out has one producer"))
    produced = [p for *_, p in owners]
    for name, stage in stages.items():
        for i, dep in enumerate(stage.deps):
            if f"stages.{name}.deps.{i}" in bad_paths:
                continue
            if not any(dag.overlaps(dep, p) for p in produced) and not (root / dep).exists():
                issues.append(SpecIssue(doc.path, doc.line(("stages", name, "deps", i)),
                                        f"stages.{name}.deps", f"'{dep}' does not exist and no stage writes it"))
    return issues


def ensure_importable(root: Path) -> None:
    """Put the project root first on ``sys.path`` so its task packages import."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
