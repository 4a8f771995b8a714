"""The Python a ``cmd`` stage runs, found without running it: its scripts and the local modules they import.

A command's fingerprint is its text and its declared deps: DVC (and conveyor) miss a change to
``scripts/utils.py`` when ``python scripts/train.py`` imports it and the stage does not declare
it. The scripts are found in the command (``python[3] [options] FILE.py`` or ``-m MODULE``), then
their imports followed with ``ast`` as Python would resolve them: beside the script (its folder
is first on ``sys.path``), or from the working directory for ``-m``, or a package at the project
root. Imports inside functions count too; nothing is executed.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.spec.sources import parse

if TYPE_CHECKING:
    from conveyor.spec.project import Project

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}


@dataclass(frozen=True)
class LocalImport:
    """``importer`` (a project file, at ``line``) imports ``module``, the project file ``path``."""

    importer: str
    line: int
    module: str
    path: str


def scripts(command: str, cwd: Path) -> list[tuple[Path, bool]]:
    """The Python files ``command`` runs: (file, run with ``-m``), for files that exist."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so when it runs
        return []
    found: list[tuple[Path, bool]] = []
    for i, token in enumerate(tokens):
        if not _PYTHON.match(Path(token).name):
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].startswith("-") and tokens[j] != "-m":
            j += 2 if tokens[j] in _OPTIONS_WITH_VALUE else 1
        if j + 1 < len(tokens) and tokens[j] == "-m":
            path = _module_path(cwd, tokens[j + 1])
            if path is not None:
                found.append((path, True))
        elif j < len(tokens) and tokens[j].endswith(".py") and (cwd / tokens[j]).is_file():
            found.append(((cwd / tokens[j]).resolve(), False))
    return found


def local_imports(script: Path, search: Sequence[Path], root: Path) -> Iterator[LocalImport]:
    """Every project module ``script`` imports, transitively, looked up in ``search`` (in order)."""
    seen: set[Path] = {script}
    todo = [script]
    while todo:
        path = todo.pop()
        for line, module in _imports(path, search, root):
            found = _module_path_in([path.parent, *search], module)
            if found is None or not found.is_relative_to(root):
                continue
            yield LocalImport(_rel(path, root), line, module, _rel(found, root))
            if found not in seen:
                seen.add(found)
                todo.append(found)


def _imports(path: Path, search: Sequence[Path], root: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of each import in ``path``; the standard library left out."""
    try:
        tree = parse(path)
    except (SyntaxError, ValueError, OSError):
        return
    package = _package_of(path, search)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and package is None:
                continue
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package or "") \
                if node.level else (node.module or "")
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            if name and name.partition(".")[0] not in sys.stdlib_module_names:
                yield node.lineno, name


def _package_of(path: Path, search: Sequence[Path]) -> str | None:
    """The dotted package ``path`` lives in, seen from the first of ``search`` that holds it."""
    for base in search:
        if path.is_relative_to(base) and path.parent != base:
            return ".".join(path.parent.relative_to(base).parts)
    return None


def _module_path(cwd: Path, module: str) -> Path | None:
    found = _module_path_in([cwd], module)
    if found is not None and found.name == "__init__.py":
        main = found.with_name("__main__.py")  # `python -m package` runs its __main__
        return main if main.is_file() else found
    return found


def _module_path_in(search: Sequence[Path], module: str) -> Path | None:
    """The file of ``module`` in the first folder of ``search`` that has it; a submodule whose
    file is not there (``from pkg import name``) resolves to nothing."""
    parts = module.split(".")
    for base in search:
        target = base.joinpath(*parts)
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def command_code(root: Path, wdir: str | None, commands: Sequence[str]) -> Iterator[tuple[Path, list[LocalImport]]]:
    """Each project script the ``commands`` run (from ``wdir``), with the project modules it imports."""
    cwd = (root / (wdir or "")).resolve()
    for command in commands:
        for script, as_module in scripts(command, cwd):
            if script.is_relative_to(root):
                yield script, list(local_imports(script, [cwd, root] if as_module else [root], root))


def undeclared(root: Path, wdir: str | None, commands: Sequence[str], deps: Sequence[str]) -> list[str]:
    """What a cmd stage runs from the project without declaring it: its scripts, and the local
    modules they import, that are neither a dep nor inside one; one sentence each."""
    declared = [(root / dep).resolve() for dep in deps]

    def covered(rel: str) -> bool:
        path = (root / rel).resolve()
        return any(path == dep or path.is_relative_to(dep) for dep in declared)

    problems: dict[str, str] = {}
    for script, imported in command_code(root, wdir, commands):
        rel = _rel(script, root)
        if not covered(rel):
            problems.setdefault(rel, f"it runs {rel}, which is not among its deps: a change to it will not "
                                     f"rerun the stage; add '{rel}' to its deps")
        for found in imported:
            if not covered(found.path):
                problems.setdefault(found.path, f"{found.importer}:{found.line} imports '{found.module}' "
                                                f"({found.path}), which is not among its deps: a change to "
                                                f"it will not rerun the stage; add '{found.path}' to its deps")
    return list(problems.values())


def undeclared_code(project: Project) -> list[str]:
    """``undeclared`` for every cmd stage of ``project``, each sentence after the file and key where its
    deps are written (the spec, or the dvc.yaml a placement spec runs)."""
    declared_in = project.rel(project.dvc.file if project.dvc is not None else project.spec_path)
    return [f"{declared_in} stages.{name}: {problem}" for name, stage in project.pipeline.stages.items()
            if stage.cmd is not None for problem in undeclared(project.root, stage.wdir, stage.commands, stage.deps)]
