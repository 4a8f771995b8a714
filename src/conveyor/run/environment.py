"""What a stage's result depends on that no fingerprint holds: package versions and the CPU's kernels.

dvc.lock records deps, params, code and outs; a model's bytes also follow the versions of the
libraries its code imports and the kernels the CPU gave them. Neither makes a stage stale
(DVC's record stays DVC's), but "why did my model change?" needs them: each stage's run
record keeps the versions of the packages its code imports (found with ``ast``, as its
fingerprint finds its code) and the CPU settings it ran with, and ``status`` and the run's
summary name what changed since its last run.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from conveyor.run.determinism import PINS
from conveyor.run.record import RunRecord, StageRecord, newest_runs
from conveyor.spec.project import Project
from conveyor.spec.scripts import command_code
from conveyor.spec.sources import parse

# the environment variables that choose kernels or threads, where a user set them
_KERNEL_VARIABLES = tuple(dict.fromkeys([*PINS, "MKL_ENABLE_INSTRUCTIONS", "NPY_DISABLE_CPU_FEATURES",
                                         "NPY_ENABLE_CPU_FEATURES", "GLIBC_TUNABLES"]))
# x86-64 microarchitecture levels, by the /proc/cpuinfo flags each adds
_X86_LEVELS = (("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
               ("x86-64-v3", {"avx2", "bmi1", "bmi2", "fma", "movbe"}),
               ("x86-64-v2", {"sse4_2", "popcnt", "ssse3"}))


def code_files(project: Project, stage: str) -> list[Path]:
    """The stage's own Python: its task's modules, or the scripts its command runs and their local modules."""
    spec = project.pipeline.stages[stage]
    if spec.task:
        return project.task_sources(stage)
    files = [path for script, imported in command_code(project.root, spec.wdir, spec.commands)
             for path in (script, *(project.root / found.path for found in imported))]
    return list(dict.fromkeys(files))


def packages(files: Iterable[Path]) -> dict[str, str]:
    """Installed distribution -> version, for each top-level package ``files`` import (stdlib and
    project modules left out: those without a distribution)."""
    found: dict[str, str] = {}
    for name in sorted({top for path in files for top in _top_level_imports(path)}):
        for dist in _distributions(name):
            version = _version(dist)
            if version is not None:
                found[dist] = version
    return found


def cpu_settings() -> dict[str, str]:
    """The CPU's instruction-set level and thread count, and any kernel variable set in the environment."""
    settings = {"isa": _isa(), "threads": str(os.cpu_count() or 1)}
    settings |= {k: os.environ[k] for k in _KERNEL_VARIABLES if k in os.environ}
    return settings


def notes(before: StageRecord | None, now: StageRecord) -> list[str]:
    """What changed in the stage's environment since ``before`` (its last successful run)."""
    if before is None:
        return []
    said: list[str] = []
    was = before.packages or {}
    versions = [f"{dist} {was[dist]} → {version}" for dist, version in (now.packages or {}).items()
                if was.get(dist, version) != version]
    if versions:
        said.append(f"environment changed since the last run: {', '.join(versions)}")
    if (before.deterministic is None) != (now.deterministic is None):
        said.append("kernel paths pinned since the last run (deterministic: true)" if now.deterministic is not None
                    else "kernel paths no longer pinned since the last run (deterministic: false)")
    elif before.cpu and now.cpu and now.deterministic is None:  # pinned both times: the CPU did not decide
        cpu = [f"{key} {before.cpu.get(key, '(unset)')} → {now.cpu.get(key, '(unset)')}"
               for key in dict.fromkeys([*before.cpu, *now.cpu]) if before.cpu.get(key) != now.cpu.get(key)]
        if cpu:
            said.append(f"CPU kernels changed since the last run: {', '.join(cpu)}")
    return said


class History:
    """The environment of each stage at its last success, read from the project's run records
    the first time it is asked for (a run with nothing to do never reads them)."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._last: dict[str, StageRecord] | None = None

    def notes(self, stage: str) -> list[str]:
        """What changed in ``stage``'s environment since its last success (information, not a reason to run)."""
        if self._last is None:
            spec = self.project.rel(self.project.spec_path)
            runs = (r for r in newest_runs(self.project.root) if r.spec in (spec, ""))
            self._last = last_successes(runs, self.project.order)
        before = self._last.get(stage)
        if before is None:
            return []
        pinned = PINS if self.project.pipeline.stages[stage].deterministic else None
        return notes(before, current(self.project, stage, pinned))


def last_successes(runs: Iterable[RunRecord], stages: Iterable[str]) -> dict[str, StageRecord]:
    """The record of each stage's latest success in ``runs`` (newest first: read no further than the
    run where the last of ``stages`` is found)."""
    wanted, found = set(stages), {}
    for run in runs:
        for name, stage in run.stages.items():
            if name in wanted and name not in found and stage.status == "succeeded":
                found[name] = stage
        if len(found) == len(wanted):
            break
    return found


def current(project: Project, stage: str, pinned: Mapping[str, str] | None) -> StageRecord:
    """The environment the stage would run in now, as a record's fields hold it."""
    return StageRecord(packages=packages(code_files(project, stage)), cpu=cpu_settings(),
                       deterministic=dict(pinned) if pinned is not None else None)


def _top_level_imports(path: Path) -> set[str]:
    try:
        tree = parse(path)
    except (SyntaxError, ValueError, OSError):
        return set()
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    return {n.partition(".")[0] for n in names} - set(sys.stdlib_module_names)


@functools.cache
def _distributions(top: str) -> list[str]:
    """The installed distributions that provide the top-level package ``top`` (none for a project module).

    ``importlib.metadata.packages_distributions()`` reads every distribution's file list (0.2 s
    here): too slow for ``status``. A distribution named as the package is taken at once;
    otherwise those of the ``*.dist-info`` folders beside the package that provide it
    (:func:`provided`), those whose name holds the package's first (``xgboost_cpu``).
    """
    if _version(top) is not None:
        return [top]
    spec = _find_spec(top)
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return []
    origin = Path(spec.origin)
    folder = origin.parent.parent if origin.name == "__init__.py" else origin.parent
    infos = sorted(provided(folder).get(top, []), key=lambda p: top.lower() not in p.name.lower())
    return [_dist_name(info) for info in infos]


@functools.cache
def provided(folder: Path) -> dict[str, list[Path]]:
    """Top-level package -> the ``*.dist-info`` folders in ``folder`` that provide it: as their
    ``top_level.txt`` says, else their file list (``top/...``, ``top.py``, ``top.cpython-*.so``).
    Read once per process and folder (30 ms for 200 distributions); a warm runner reads those of
    its ``sys.path`` before it forks (:mod:`conveyor.cli.warm_runner`): an install changes the
    folder's mtime, and with it the runner."""
    found: dict[str, list[Path]] = {}
    for info in sorted(folder.glob("*.dist-info")):
        names = info / "top_level.txt"
        if names.is_file():
            tops = set(names.read_text(encoding="utf-8", errors="replace").split())
        else:
            record = info / "RECORD"
            lines = record.read_text(encoding="utf-8", errors="replace").splitlines() if record.is_file() else []
            paths = [line.partition(",")[0] for line in lines]
            tops = {path.split("/")[0].partition(".")[0] for path in paths if "/" in path or "." in path}
        for top in sorted(top for top in tops if top.isidentifier()):  # not the dist-info folder's own
            found.setdefault(top, []).append(info)
    return found


def _find_spec(top: str) -> importlib.machinery.ModuleSpec | None:
    """Where ``top`` would be imported from, without importing it."""
    try:
        return importlib.machinery.PathFinder.find_spec(top)
    except (ImportError, ValueError):
        return None


def _dist_name(info: Path) -> str:
    """The distribution's name as its metadata gives it (``xgboost-cpu``)."""
    try:
        return importlib.metadata.Distribution.at(info).metadata["Name"] or info.name.split("-")[0]
    except (OSError, KeyError):
        return info.name.split("-")[0]


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _isa() -> str:
    import platform

    machine = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return machine
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return next((level for level, needs in _X86_LEVELS if needs <= flags), machine)
