"""An existing ``dvc.yaml``, read through DVC's own code, as a conveyor project (SPEC.md §2.3).

DVC's loader does the reading: its schema, ``vars``, ``${}`` interpolation, ``foreach``
and ``matrix`` (stages named as DVC names them, ``train@small-0.1``), ``wdir``, params
files, and its graph (edges, overlapping outs, cycles). What conveyor takes from each
stage is what it needs to schedule and run it: the command, the paths it reads and
writes (relative to the project root), ``persist``, ``frozen``, the declared metrics.
Whether a stage changed and how it is recorded stay DVC's (:mod:`conveyor.dvc.record`).

Where the stages run is added without touching dvc.yaml: a placement spec
(``dvc: dvc.yaml``, ``profiles:``, ``placement:``) maps stage-name globs to a profile,
retries and a timeout. DVC is imported only here and only when such a project is loaded.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from conveyor.errors import SpecError, SpecIssue, did_you_mean
from conveyor.spec import dvcindex, dvcstages
from conveyor.spec.dvcerrors import dvc_issues
from conveyor.spec.dvcload import DvcLoaded, SchemaChecked, stamp
from conveyor.spec.models import DvcPipeline, Pipeline, Stage
from conveyor.spec.parse import parse_dvc_pipeline
from conveyor.spec.yamlmap import Key, LoadedYaml, YamlRefused, load_yaml, yaml_issue

if TYPE_CHECKING:
    from dvc.dvcfile import ProjectFile
    from dvc.repo import Repo
    from dvc.stage import PipelineStage
    from dvc.stage import Stage as DvcStage

    from conveyor.spec.project import Project


@dataclass(frozen=True)
class DvcSource:
    """What a run needs to know of the dvc.yaml a project runs.

    ``shell``: how DVC runs a command (the user's ``$SHELL`` without its rc files, as
    ``dvc repro`` does); ``frozen``: stages whose command never runs (DVC only checks and
    records their outs); ``metrics``: per stage, the metrics files dvc.yaml declares that
    the stage writes (its own ``metrics:`` and the top-level ones under its outs);
    ``sources`` and ``unmade``: per stage, the ``.dvc`` files it reads and the deps no stage
    of the repository writes (:class:`conveyor.spec.dvcindex.Upstream`); ``addresses``: the
    stages of other dvc.yaml files that ``dvc repro`` of this one runs too (upstream of its
    stages), by the name DVC prints (``sub/dvc.yaml:make``): their file and their own name there;
    ``params`` and ``items``: per stage, the params it declares and its foreach/matrix item,
    which the run record keeps (``conveyor compare`` shows them); ``inputs``: the files the
    project was loaded from, with the digest of their bytes then, where they are known
    (:mod:`conveyor.spec.snapshot`; :mod:`conveyor.dvc.stamps` keeps DVC's answers with them).
    """

    file: Path
    shell: tuple[str, ...]
    frozen: frozenset[str] = frozenset()
    metrics: Mapping[str, tuple[str, ...]] | None = None
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    unmade: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    loaded: DvcLoaded | None = field(default=None, compare=False, repr=False)
    addresses: Mapping[str, tuple[Path, str]] = field(default_factory=dict)
    params: Mapping[str, dvcstages.Declared] = field(default_factory=dict)
    items: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    inputs: Mapping[str, str | None] | None = field(default=None, compare=False, repr=False)
    _files: dict[str, tuple[Any, Any]] = field(default_factory=dict, compare=False, repr=False)

    def file_of(self, stage: str) -> Path:
        """The dvc.yaml that declares ``stage`` (its dvc.lock lies beside it)."""
        return self.addresses[stage][0] if stage in self.addresses else self.file

    def params_of(self, root: Path, stage: str) -> dict[str, Any]:
        """The params ``stage`` declares, with their values in the files now (the run record's)."""
        return dvcstages.params_values(root, self.params.get(stage, ()), self._files)

    def name_in_file(self, stage: str) -> str:
        """``stage`` as its own dvc.yaml and dvc.lock name it (``make`` for ``sub/dvc.yaml:make``)."""
        return self.addresses[stage][1] if stage in self.addresses else stage


def is_placement(doc: LoadedYaml) -> bool:
    """A spec that places the stages of a dvc.yaml (it has a top-level ``dvc:`` key)."""
    return isinstance(doc.data, dict) and "dvc" in doc.data


def load_dvc_project(dvc_file: Path, placement: LoadedYaml | None = None, *, all_pipelines: bool = False
                     ) -> Project:
    """The project of ``dvc_file`` (:func:`_load`), from the snapshot of its last load while nothing
    that load read has changed (:mod:`conveyor.spec.snapshot`)."""
    from conveyor.spec import snapshot

    return snapshot.loaded(dvc_file, placement.path if placement is not None else None, all_pipelines,
                           lambda: _load(dvc_file, placement, all_pipelines=all_pipelines))


def _load(dvc_file: Path, placement: LoadedYaml | None = None, *, all_pipelines: bool = False) -> Project:
    """The project that runs ``dvc_file``, placed as ``placement`` says (None: every stage local);
    with ``all_pipelines``, and every stage of the repository's other dvc.yaml files (``dvc repro -P``).

    Raises :class:`SpecError` with every problem found: DVC's own complaints about the file
    (with their line), placement globs that match no stage, unknown profiles, and what
    conveyor cannot honour (an out outside the repository, or reached through a link leading out).
    """
    from conveyor.plan import dag
    from conveyor.spec.project import Project

    spec = parse_dvc_pipeline(placement) if placement is not None else DvcPipeline()
    written = _read(dvc_file)
    refused = _refused_inputs(dvc_file, written) + _empty_groups(written)
    if refused:
        raise SpecError(refused)
    root, loaded, stages, others = _dvc_stages(dvc_file, written)
    converted, issues = dvcstages.converted(root, dvc_file, written, stages)
    graph: dict[str, frozenset[str]] = {}
    extra: dict[str, PipelineStage] = {}
    if not issues:  # the stages of other dvc.yaml files this one reads from, converted in their own file
        graph, extra = dvcindex.graph(root, dvc_file, written, stages, others, everything=all_pipelines)
        for path, named in dvcstages.by_file(extra).items():
            theirs, found = dvcstages.converted(root, path, _read(path), named)
            converted.update(theirs)
            issues += found
    if placement is not None:
        converted, placed_issues = _placed(converted, spec, placement)
        issues += placed_issues + _model_issues(spec, converted, placement, dvc_file)
    if issues:
        raise SpecError(sorted(issues, key=lambda i: (str(i.file), i.line or 0)))
    everything = {**stages, **extra}
    outside = dvcindex.upstream(root, everything, others)
    pipeline = Pipeline(pipeline=spec.pipeline or root.name, profiles=spec.profiles, stages=converted,
                        model=spec.model)
    params_path = root / "params.yaml"
    params = _params(params_path)
    source = DvcSource(dvc_file, shell=_shell(), frozen=frozenset(n for n, s in everything.items() if s.frozen),
                       metrics=_metrics(written, root, converted), sources=outside.sources,
                       unmade=outside.unmade, loaded=loaded,
                       addresses={name: (Path(stage.path), str(stage.name)) for name, stage in extra.items()},
                       params={name: dvcstages.declared_params(root, stage) for name, stage in everything.items()},
                       items={name: item for name, stage in everything.items()
                              if (item := dvcstages.item_of(stage)) is not None})
    return Project(root, placement.path if placement is not None else dvc_file, pipeline, params_path, params,
                   {name: graph[name] for name in dag.topological_order(graph, converted)}, dvc=source)


def _model_issues(spec: DvcPipeline, stages: dict[str, Stage], doc: LoadedYaml, dvc_file: Path) -> list[SpecIssue]:
    """A model's files must be written by stages of the dvc.yaml (outs, metrics, or inside an out)."""
    if spec.model is None:
        return []
    written = [w.rstrip("/") for stage in stages.values() for w in stage.written]
    return [SpecIssue(doc.path, doc.line(("model", "files", name)), f"model.files.{name}",
                      f"'{path}' is not written by any stage of {dvc_file.name} (an out, or a file in one): "
                      "a model is what the pipeline makes")
            for name, path in spec.model.files.items()
            if not any(path == w or path.startswith(w + "/") for w in written)]


def _read(path: Path) -> LoadedYaml:
    """dvc.yaml with the line of each key (for errors). DVC reports bad YAML itself; a document
    conveyor refuses (a YAML bomb hangs DVC, deep nesting crashes ruamel's C composer) never reaches it."""
    try:
        return load_yaml(path, dvc_file=True)
    except YamlRefused as exc:
        raise SpecError([yaml_issue(path, exc)]) from None
    except (OSError, yaml.YAMLError):
        return LoadedYaml(path, None)


def _vet(path: Path) -> None:
    """Another DVC file of the repository (a dvc.yaml, a ``.dvc`` file), checked as this one is
    before DVC parses it: the same refusals, naming that file."""
    written = _read(path)
    refused = _refused_inputs(path, written) + _empty_groups(written)
    if refused:
        raise SpecError(refused)


def _refused_inputs(dvc_file: Path, written: LoadedYaml) -> list[SpecIssue]:
    """The YAML files DVC reads for ``dvc_file`` (``vars`` and params files) that conveyor refuses
    to read (:class:`YamlRefused`): checked before DVC parses them with no bound at all."""
    issues: list[SpecIssue] = []
    for path in _yaml_inputs(dvc_file, written):
        try:
            load_yaml(path)
        except YamlRefused as exc:
            issues.append(yaml_issue(path, exc))
        except (OSError, yaml.YAMLError):
            continue  # bad syntax: DVC names it where it reads the file
    return issues


def _yaml_inputs(dvc_file: Path, written: LoadedYaml) -> list[Path]:
    """Files that DVC reads as YAML for ``dvc_file``: params.yaml beside it and in each stage's
    wdir, ``vars`` files and the params files stages name (any but .toml, .json, .py is YAML to DVC)."""
    base = dvc_file.parent
    data = written.data if isinstance(written.data, dict) else {}
    found = [base / "params.yaml", *_vars_files(base, data)]
    stages = data.get("stages")
    for body in stages.values() if isinstance(stages, dict) else ():
        if not isinstance(body, dict):
            continue
        wdir = body.get("wdir")
        here = base / wdir if isinstance(wdir, str) else base
        found += [here / "params.yaml", *_vars_files(here, body)]
        params = body.get("params")
        for item in params if isinstance(params, list) else ():
            found += [here / str(name) for name in item] if isinstance(item, dict) else []
    return [path for path in dict.fromkeys(found) if "${" not in str(path)
            and path.suffix.lower() not in (".toml", ".json", ".py") and path.exists()]


def _empty_groups(written: LoadedYaml) -> list[SpecIssue]:
    """A ``matrix`` or ``foreach`` with nothing to expand: DVC drops the stage without a word
    (or, for ``matrix: {}``, fails an assertion), where conveyor names it."""
    issues: list[SpecIssue] = []
    stages = written.data.get("stages") if isinstance(written.data, dict) else None
    for name, body in stages.items() if isinstance(stages, dict) else ():
        matrix = body.get("matrix") if isinstance(body, dict) else None
        foreach = body.get("foreach") if isinstance(body, dict) else None
        empty: list[tuple[Key, str]] = []
        if isinstance(matrix, dict):
            empty += [(("stages", name, "matrix"), "an empty matrix: it expands to no stage")] if not matrix else \
                [(("stages", name, "matrix", k), "an empty list: the matrix expands to no stage")
                 for k, v in matrix.items() if v == []]
        if foreach in ([], {}):
            empty.append((("stages", name, "foreach"), "nothing to loop over: it expands to no stage"))
        issues += [SpecIssue(written.path, written.line(key), ".".join(map(str, key)), message)
                   for key, message in empty]
    return issues


def _vars_files(base: Path, body: Mapping[str, Any]) -> list[Path]:
    """The files in ``body``'s ``vars`` (``file.yaml`` or ``file.yaml:key,...``)."""
    listed = body.get("vars")
    return [base / item.partition(":")[0] for item in listed if isinstance(item, str)] \
        if isinstance(listed, list) else []


def _dvc_stages(dvc_file: Path, written: LoadedYaml
                ) -> tuple[Path, DvcLoaded, dict[str, PipelineStage], list[DvcStage]]:
    """DVC's stages of ``dvc_file`` by name, the root of the DVC repository holding it, that
    repository and file, open, for the run's record, and the stages of the repository's other
    DVC files (``.dvc`` files, other dvc.yaml)."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo
    from dvc.scm import SCMError

    try:
        repo = Repo(str(dvc_file.parent))
    except NotDvcRepoError:
        raise SpecError([SpecIssue(dvc_file, None, "", f"{dvc_file.parent} is not in a DVC repository: run "
                                   "`git init && dvc init` there first (dvc.yaml runs inside one)")]) from None
    except SCMError:  # .dvc/ without git around it
        raise SpecError([SpecIssue(dvc_file, None, "", f"is not in a git repository: DVC keeps its record beside "
                                   f"git; run `git init` in {dvc_file.parent} (or `dvc config core.no_scm true` "
                                   "to use DVC without git)")]) from None
    lock = dvc_file.with_suffix(".lock")
    lock_stamp = stamp(lock)  # before DVC reads it: written in between, the record reads it again
    try:
        loaded, stages = _stages_of(repo, dvc_file, written)
        locked = frozenset(loaded.lockfile_contents.get("stages", {}))
        others = dvcindex.other_stages(repo, dvc_file, _vet)
    except BaseException:
        repo.close()
        raise
    return Path(repo.root_dir), DvcLoaded(repo, stages, locked, lock, lock_stamp), stages, others



def _stages_of(repo: Repo, dvc_file: Path, written: LoadedYaml) -> tuple[ProjectFile, dict[str, PipelineStage]]:
    """The file as DVC loads it and its stages by name; DVC's complaints as conveyor's issues."""
    from dvc.dvcfile import load_file
    from dvc.exceptions import DvcException

    checked = SchemaChecked(Path(repo.root_dir), dvc_file)
    try:
        loaded = load_file(repo, str(dvc_file))  # absolute: DVC reads a relative path from the cwd
        if checked.before:
            loaded.SCHEMA = None  # these very bytes passed DVC's schema check (it only checks: nothing changes)
        stages = {stage.name: stage for stage in loaded.stages.values()}
    except DvcException as exc:
        raise SpecError(dvc_issues(dvc_file, written, exc)) from None
    except (AssertionError, AttributeError, KeyError, TypeError, ValueError) as exc:  # what DVC's schema let through
        said = str(exc).rstrip(".") or type(exc).__name__
        raise SpecError([SpecIssue(dvc_file, written.line(("stages",)), "stages",
                                   f"DVC cannot load it: {said}; `dvc repro` fails on it too")]) from None
    if not stages:
        raise SpecError([SpecIssue(dvc_file, written.line(("stages",)), "stages", "no stages to run")])
    checked.remember()
    return loaded, stages


def _placed(stages: dict[str, Stage], spec: DvcPipeline, doc: LoadedYaml) -> tuple[dict[str, Stage], list[SpecIssue]]:
    """``stages`` with the placement spec applied; every glob applies where it matches, in order."""
    issues: list[SpecIssue] = []
    settings: dict[str, dict[str, Any]] = {name: {} for name in stages}
    for glob, placement in spec.placement.items():
        matched = [name for name in stages if fnmatch.fnmatchcase(name, glob)]
        if not matched:
            issues.append(SpecIssue(doc.path, doc.line(("placement", glob)), f"placement.{glob}",
                                    f"matches no stage of {spec.dvc}{did_you_mean(glob, stages)}; "
                                    f"stages: {', '.join(stages)}"))
        if placement.on is not None and placement.on not in spec.profiles:
            issues.append(SpecIssue(doc.path, doc.line(("placement", glob, "on")), f"placement.{glob}.on",
                                    f"unknown profile '{placement.on}'{did_you_mean(placement.on, spec.profiles)}"
                                    f"; profiles: {', '.join(spec.profiles) or '(none: add profiles:)'}"))
        for name in matched:
            settings[name].update(placement.model_dump(exclude_none=True))
    return {name: stage.model_copy(update=settings[name]) for name, stage in stages.items()}, issues


def _metrics(written: LoadedYaml, root: Path, converted: Mapping[str, Stage]) -> dict[str, tuple[str, ...]]:
    """Per stage, its metrics files: its own ``metrics:`` and the top-level ones inside its outs."""
    top = _top_level_metrics(written, root)
    found: dict[str, tuple[str, ...]] = {}
    for name, stage in converted.items():
        inside = [m for m in top if any(m == out or m.startswith(out.rstrip("/") + "/") for out in stage.outs)]
        found[name] = tuple(dict.fromkeys([*stage.metrics, *inside]))
    return found


def _top_level_metrics(written: LoadedYaml, root: Path) -> list[str]:
    listed = written.data.get("metrics") if isinstance(written.data, dict) else None
    if not isinstance(listed, list):
        return []
    base = written.path.parent
    return [dvcstages.rel(root, str(base / m)) for m in listed if isinstance(m, str) and "${" not in m]


def _params(path: Path) -> dict[str, Any]:
    try:
        data = load_yaml(path).data if path.exists() else None
    except yaml.YAMLError:
        return {}  # DVC reports a broken params file where a stage reads it
    return data if isinstance(data, dict) else {}


def _shell() -> tuple[str, ...]:
    """The shell ``dvc repro`` runs a command with, as an argv prefix before the command."""
    from dvc.stage.run import _make_cmd, get_executable

    executable = get_executable()
    return tuple(_make_cmd(executable, "")[:-1]) if executable else ("/bin/sh", "-c")

