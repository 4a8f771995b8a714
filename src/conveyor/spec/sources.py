"""A task's code, found without importing it: its module file and the project modules it uses.

``conveyor validate`` must not import tasks (they import torch, xgboost...), so a task is
looked up on disk and its source parsed with ``ast``. The same walk gives the files a
stage's fingerprint covers: its module and, transitively, every module of the project's
``task_packages`` it imports.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from conveyor.errors import did_you_mean


def module_file(root: Path, module: str) -> Path | None:
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


def in_packages(module: str, packages: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def package_problem(package: str) -> str | None:
    """Why ``package`` cannot hold tasks, or None: Python's standard library (``shutil``,
    ``os``) is not stage code, and a project package of that name would be shadowed by it."""
    top = package.partition(".")[0]
    if top in sys.stdlib_module_names:
        return (f"'{top}' is a module of Python's standard library: a task comes from the project's own "
                "packages or an installed package, named in task_packages")
    return None


def task_problem(root: Path, task: str, packages: Sequence[str]) -> str | None:
    """Why ``module:function`` is not a task of this project, or None when it is one."""
    module, _, function = task.partition(":")
    if not in_packages(module, packages):
        return f"task '{task}' is outside task_packages ({', '.join(packages)}); move it or add its package"
    stdlib = package_problem(module)
    if stdlib:
        return f"task '{task}': {stdlib}"
    path = module_file(root, module)
    if path is None:
        return f"unknown task '{task}': module '{module}' not found under {root}"
    try:
        tree = parse(path)
    except SyntaxError as exc:
        return f"task '{task}': {exc.filename}:{exc.lineno}: {exc.msg}; fix the module"
    defined = sorted(_top_level_names(tree))
    if function not in defined:
        return f"unknown task '{task}': no function '{function}' in {path.name}{did_you_mean(function, defined)}"
    return None


_PARSING = threading.Lock()


def parse(path: Path) -> ast.Module:
    """``path``'s source as a syntax tree, one parse at a time in the process: stages check their
    code in parallel threads, and CPython 3.11's ``ast.parse`` is not thread-safe ("AST
    constructor recursion depth mismatch" when two threads parse at once). The lock covers
    conveyor's parses only: a library in a running stage's thread may parse meanwhile (seen in
    CI: the reference pipeline's first run failed a stage's start with that SystemError), so a
    parse the other thread spoiled is done again (the counter is reset at each parse)."""
    source = path.read_bytes()
    for attempt in range(_PARSE_TRIES):
        with _PARSING:
            try:
                return ast.parse(source, filename=str(path))
            except SystemError as exc:
                if "recursion depth mismatch" not in str(exc) or attempt == _PARSE_TRIES - 1:
                    raise
    raise AssertionError("unreachable")


_PARSE_TRIES = 5


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines or imports at top level: where a task function can come from."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def local_sources(root: Path, module: str, packages: Sequence[str]) -> set[Path]:
    """The module's file and, transitively, every module of ``packages`` it imports."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = module_file(root, name)
        if path is None or path in seen:
            continue
        seen.add(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        try:
            tree = parse(path)
        except SyntaxError:
            continue  # the module itself is in the set; what it imports cannot be known
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else (node.module or "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            todo += [n for n in names if in_packages(n, packages)]
    return seen
