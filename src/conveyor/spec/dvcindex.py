"""The DVC repository around a dvc.yaml, as ``dvc repro`` sees it: every other dvc.yaml and every
``.dvc`` file (``dvc add``), loaded by DVC.

``dvc repro`` builds its graph over the repository's whole index, so an out that a ``.dvc`` file
or another dvc.yaml already tracks is refused (duplicated, or inside a tracked directory) before
anything runs, and a ``.dvc`` file is a stage upstream of those that read its data. conveyor
runs one dvc.yaml, and needs the rest of the index for three answers: the refusal, which
``.dvc`` files each of its stages reads (:mod:`conveyor.dvc.sources` commits them as
``dvc repro`` does), and which stages of other dvc.yaml files it reads the outs of (``dvc repro``
runs those too, first). DVC is imported only here and only when such a project is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import SpecError, SpecIssue
from conveyor.spec.yamlmap import LoadedYaml

if TYPE_CHECKING:
    from dvc.repo import Repo
    from dvc.stage import Stage


@dataclass(frozen=True)
class Upstream:
    """What the rest of the repository means to each stage of the dvc.yaml, by stage name.

    ``sources``: the ``.dvc`` files (relative to the root) whose data the stage reads;
    ``unmade``: its deps (relative to the root) that no stage of the repository writes, which
    must then exist when it runs (``dvc repro`` fails on them: No such file or directory).
    """

    sources: Mapping[str, tuple[str, ...]]
    unmade: Mapping[str, tuple[str, ...]]


def other_stages(repo: Repo, dvc_file: Path, vet: Callable[[Path], None]) -> list[Stage]:
    """The stages of every DVC file of ``repo`` but ``dvc_file`` (already loaded by the caller);
    a file DVC cannot load is a :class:`SpecError`, as it fails ``dvc repro``. ``vet`` sees each
    file before DVC parses it (with no bound: a YAML bomb in any of them would hang the walk),
    and raises a :class:`SpecError` naming it when conveyor refuses to read it."""
    from dvc.exceptions import DvcException

    try:
        return _walk(repo, dvc_file, vet)
    except (DvcException, AssertionError, AttributeError, KeyError, TypeError, ValueError) as exc:
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise SpecError([SpecIssue(dvc_file, None, "", f"{said} (another DVC file of the repository: "
                                   "`dvc repro` refuses it too)")]) from None


def _walk(repo: Repo, dvc_file: Path, vet: Callable[[Path], None]) -> list[Stage]:
    """The walk is DVC's own (``dvc.repo.index.collect_files``: its ignore rules, its file names,
    tracked outs not descended into), less the one file, so no file is parsed twice."""
    from dvc.dvcfile import is_valid_filename
    from dvc.repo.index import Index

    skip = os.path.abspath(dvc_file)
    found: list[Stage] = []
    outs: set[str] = set()
    for root, dirs, files in repo.dvcignore.walk(repo.fs, repo.root_dir, followlinks=False):
        for name in files:
            path = repo.fs.join(root, name)
            if path == skip or not is_valid_filename(name) or repo.scm.is_ignored(path):
                continue
            vet(Path(path))
            stages = Index.from_file(repo, path).stages
            found += stages
            outs.update(out.fs_path for stage in stages for out in stage.outs if out.protocol == "local")
        dirs[:] = [d for d in dirs if repo.fs.join(root, d) not in outs
                   and not repo.scm.is_ignored(repo.fs.join(root, d) + os.sep)]
    return found


def upstream(root: Path, ours: Mapping[str, Stage], others: Sequence[Stage]) -> Upstream:
    """For each of ``ours``, the ``.dvc`` files it reads and the deps nobody writes: each dep asked
    of an index of the repository's outs (:class:`conveyor.plan.dag.PathIndex`), not of every out
    (at 5,000 stages every pair was 21 % of `conveyor status`)."""
    from dvc.dependency.param import ParamsDependency

    from conveyor.plan.dag import PathIndex

    written, data = PathIndex(), PathIndex()
    for stage in [*ours.values(), *others]:
        for out in stage.outs:
            written.add(_posix(out.fs_path), "")
    for other in others:
        if other.is_data_source:
            for out in other.outs:
                data.add(_posix(out.fs_path), _rel(root, other.path))
    sources: dict[str, tuple[str, ...]] = {}
    unmade: dict[str, tuple[str, ...]] = {}
    for name, stage in ours.items():
        deps = [dep for dep in stage.deps if not isinstance(dep, ParamsDependency) and dep.protocol == "local"]
        found = sorted({key for dep in deps for key in data.keys(_posix(dep.fs_path))})  # in the repository's order
        sources[name] = tuple(dict.fromkeys(data.owners[key] for key in found))
        unmade[name] = tuple(_rel(root, dep.fs_path) for dep in deps if not written.keys(_posix(dep.fs_path)))
    return Upstream(sources, unmade)


def _posix(path: str) -> str:
    return path.replace(os.sep, "/")


def _rel(root: Path, path: str) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


def graph(root: Path, dvc_file: Path, written: LoadedYaml, stages: Mapping[str, Stage],
          others: Sequence[Stage], *, everything: bool = False) -> tuple[dict[str, frozenset[str]], dict[str, Stage]]:
    """DVC's own graph of the repository (an edge where an out is, holds or lies in a dep), as
    ``dvc repro`` builds it: its refusals (an out duplicated or overlapping, in this file or
    against a ``.dvc`` file or another dvc.yaml; a cycle) as a :class:`SpecError` before anything
    runs. Returns, for each stage that ``dvc repro`` of ``stages`` runs, those it waits for, and
    the stages of other dvc.yaml files among them (:func:`reached`; ``everything``: all of them,
    as ``dvc repro -P`` runs them), by name (:func:`address`)."""
    from dvc.exceptions import DvcException
    from dvc.repo.graph import build_graph
    from dvc.stage import PipelineStage

    try:
        # Last stage first: DVC's cycle check (networkx's find_cycle) walks down from each node in
        # the order given, through nodes it has seen before too, so in dvc.yaml's order (what a
        # stage reads is usually written above it) a chain of N stages cost N^2/2 steps.
        built = build_graph([*others, *list(stages.values())[::-1]])
    except DvcException as exc:  # overlapping outs, a cycle, an out that is also a dep
        raise SpecError([SpecIssue(dvc_file, written.line(("stages",)), "stages", " ".join(str(exc).split()))]
                        ) from None
    chosen = [s for s in others if isinstance(s, PipelineStage)] if everything else reached(built, stages.values())
    extra = {address(root, dvc_file, stage): stage for stage in chosen}
    named = {id(stage): name for name, stage in [*stages.items(), *extra.items()]}
    ups: dict[str, set[str]] = {name: set() for name in [*stages, *extra]}
    for dependent, dependency in built.edges:
        if id(dependent) in named and id(dependency) in named:
            ups[named[id(dependent)]].add(named[id(dependency)])
    return {name: frozenset(found) for name, found in ups.items()}, extra


def reached(built: Any, ours: Iterable[Stage]) -> list[Stage]:
    """The stages of other dvc.yaml files that ``dvc repro`` of ``ours`` runs too: those upstream
    of them in the repository's graph ``built``, where a frozen stage cuts its own upstream, found by
    DVC's own planner (``plan_repro`` over ``get_active_graph``, as ``Repo.reproduce`` calls them).
    ``.dvc`` files are left to :mod:`conveyor.dvc.sources`."""
    from dvc.repo.reproduce import get_active_graph, plan_repro
    from dvc.stage import PipelineStage

    chosen = list(ours)
    mine = {id(stage) for stage in chosen}
    if not any(isinstance(stage, PipelineStage) and id(stage) not in mine for stage in built.nodes):
        return []  # one dvc.yaml in the repository: nothing to find (the planner costs 0.9 s at 1,000 stages)
    return [stage for stage in plan_repro(get_active_graph(built), chosen)
            if id(stage) not in mine and isinstance(stage, PipelineStage)]


def address(root: Path, dvc_file: Path, stage: Stage) -> str:
    """A stage's name as ``dvc repro`` prints it from ``root``: its name for a stage of
    ``dvc_file``, ``sub/dvc.yaml:make`` for one of another dvc.yaml (relative to the root)."""
    if os.path.abspath(stage.path) == os.path.abspath(dvc_file):
        return str(stage.name)
    return f"{_rel(root, stage.path)}:{stage.name}"
