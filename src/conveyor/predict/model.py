"""The project's model as ``conveyor predict`` and ``conveyor serve-model`` see it (SPEC.md §2.4).

A spec's ``model:`` section names the outs that make up the model, the columns a row must
have and the project's scoring function. A *version* of the model is those files: the
champion's copies in the registry, the project's own outs (the latest run), or a directory
holding them at their project paths (``--model PATH``, e.g. a champion's copy). Its id is a
hash of the files' contents, so two copies of the same model have one version.

Nothing here imports Dask, Prefect or the project's code until :func:`load_scorer` is called.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError, UsageError
from conveyor.spec.bytecode import drop_doubtful
from conveyor.spec.project import ensure_importable
from conveyor.spec.sources import local_sources

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

    from conveyor.spec.models import ModelSpec
    from conveyor.spec.project import Project

CHAMPION = "champion"
_CHUNK = 1 << 20


class ModelError(ConveyorError):
    """The model cannot be used: missing files, no features, a scorer that misbehaves."""

    exit_code = 1


@dataclass(frozen=True)
class ModelVersion:
    """One version of the model: where its files are, what it reads, and what it is."""

    files: Mapping[str, Path]  # name (as in the spec) -> the file or directory to read
    features: tuple[str, ...]  # the columns a row must have, in the order the scorer gets them
    version: str  # a hash of the files' contents (12 hex digits)
    source: str  # "champion", "latest run", or the directory given
    card: Mapping[str, Any] = field(default_factory=dict)  # what /model says beyond the above


def model_spec(project: Project) -> ModelSpec:
    """The spec's ``model:`` section, or a usage error saying how to declare one."""
    spec = project.pipeline.model
    if spec is None and project.spec_path.name == "dvc.yaml":  # DVC's file: no model: section can go there
        raise UsageError(f"{project.rel(project.spec_path)} cannot declare a model: write a small conveyor spec "
                         "beside it (configs/placed.yaml: 'dvc: dvc.yaml' and a 'model:' section of files, "
                         "features, predict) and pass it with -c configs/placed.yaml (docs/getting-started/"
                         "existing-dvc-yaml.md)")
    if spec is None:
        raise UsageError(f"{project.rel(project.spec_path)} declares no model: add a 'model:' section "
                         "(files, features, predict; see docs/how-to/predict.md)")
    return spec


def resolve(project: Project, which: str = CHAMPION) -> ModelVersion:
    """The model ``which`` names: ``champion`` (the registry's, else the latest run's outs) or a
    directory holding the model's files at their project paths."""
    spec = model_spec(project)
    if which != CHAMPION:
        base = Path(which).expanduser()
        if not base.is_dir():
            raise UsageError(f"--model {which}: not a directory (give 'champion' or a directory holding "
                             f"{', '.join(spec.files.values())} at those paths, e.g. a champion's copy)")
        return _version(spec, {n: base / p for n, p in spec.files.items()}, str(base), {}, project.root)
    from conveyor.models import registry as reg

    registry = reg.load(project.root / spec.registry)
    champion = registry.champion
    if champion is not None and champion.files:
        files = {n: project.root / p for n, p in champion.files.items()}
        card = {"run_id": champion.run_id, "promoted_at": champion.time, "metric": champion.metric,
                "metrics": dict(champion.metrics), "data_version": dict(champion.data_version),
                "git_commit": champion.git_commit}
        return _version(spec, files, CHAMPION, card, project.root)
    return _version(spec, {n: project.root / p for n, p in spec.files.items()}, "latest run",
                    _latest_run(project, champion is not None), project.root)


def _latest_run(project: Project, old_champion: bool) -> dict[str, Any]:
    """What /model says of a model no champion was promoted for: the last run that made it."""
    from conveyor.run.record import newest_runs

    why = ("the champion predates the model section (it stored no model files)" if old_champion
           else "no champion has been promoted yet")
    from conveyor.models.registry import data_version
    from conveyor.plan.dag import upstream_graph

    sources = [name for name, ups in upstream_graph(project.pipeline).items() if not ups]
    card: dict[str, Any] = {"note": f"{why}: the model of the latest successful run",
                            "data_version": data_version(project, sources)}
    run = next((r for r in newest_runs(project.root) if r.status == "succeeded"), None)
    if run is not None:
        metrics = {f"{name}:{key}": value for name, stage in run.stages.items() for key, value in stage.metrics.items()}
        card.update(run_id=run.run_id, finished=run.finished, metrics=metrics)
    return card


def _version(spec: ModelSpec, files: Mapping[str, Path], source: str, card: Mapping[str, Any],
             root: Path) -> ModelVersion:
    missing = [f"{name} ({shown(path, root)})" for name, path in files.items() if not path.exists()]
    if missing:
        hint = "run the pipeline first (`conveyor run`)" if source == "latest run" else \
            "the model's files must be at their project paths under it"
        raise ModelError(f"model ({source}) is missing {', '.join(missing)}: {hint}")
    return ModelVersion(files, _features(spec, files, source), version_of(files), source, card)


def _features(spec: ModelSpec, files: Mapping[str, Path], source: str) -> tuple[str, ...]:
    if not isinstance(spec.features, str):
        return tuple(spec.features)
    path, _, key = spec.features.rpartition(":")
    name = next(n for n, p in spec.files.items() if p == path)  # checked when the spec loaded
    try:
        value: Any = json.loads(files[name].read_text(encoding="utf-8"))
        for part in key.split("."):
            value = value[part]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"model ({source}): cannot read the features at {spec.features} ({exc!r})") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ModelError(f"model ({source}): {spec.features} is not a list of column names")
    return tuple(value)


def shown(path: Path, root: Path) -> str:
    """``path`` relative to the project root where it is inside it."""
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def version_of(files: Mapping[str, Path]) -> str:
    """A hash of the files' names and contents (a directory: every file under it, by relative path)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        path = files[name]
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            digest.update(f"{name}/{member.relative_to(path).as_posix() if path.is_dir() else ''}\0".encode())
            with member.open("rb") as fh:
                while chunk := fh.read(_CHUNK):
                    digest.update(chunk)
            digest.update(b"\0")
    return digest.hexdigest()[:12]


# --------------------------------------------------------------------------- scoring


Predict = Callable[[Any, "pd.DataFrame"], Any]


@dataclass(frozen=True)
class Scorer:
    """A loaded model version: :meth:`score` gives one float per row."""

    model: ModelVersion
    state: Any  # what the project's load function returned (or the files, without one)
    predict: Predict
    where: str  # the predict function, for messages

    def score(self, rows: pd.DataFrame) -> npt.NDArray[np.float64]:
        import numpy as np

        result = self.predict(self.state, rows.loc[:, list(self.model.features)])
        try:
            scores = np.asarray(result, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{self.where} returned {type(result).__name__}, not numbers ({exc})") from None
        if len(scores) != len(rows):
            raise ModelError(f"{self.where} returned {len(scores)} scores for {len(rows)} rows: give one per row")
        return scores


def load_scorer(root: Path, spec: ModelSpec, model: ModelVersion) -> Scorer:
    """Import the project's predict (and load) functions and load ``model`` once."""
    modules = {ref.partition(":")[0] for ref in (spec.predict, spec.load) if ref}
    drop_doubtful({path for m in modules for path in local_sources(root, m, [m.partition(".")[0]])})  # spec.bytecode
    predict = _function(root, spec.predict, "predict")
    files = dict(model.files)
    state = _function(root, spec.load, "load")(files) if spec.load else files
    return Scorer(model, state, predict, spec.predict)


def _function(root: Path, ref: str, key: str) -> Callable[..., Any]:
    ensure_importable(root)
    module, _, name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"model.{key}: cannot import {ref} ({exc})") from exc
    if not callable(fn):
        raise ModelError(f"model.{key}: {ref} is not a function")
    return fn  # type: ignore[no-any-return]
