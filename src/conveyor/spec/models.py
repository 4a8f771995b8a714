"""The pipeline spec of SPEC.md section 2, as frozen pydantic models.

Pure data: parsing and structural validation only. Cross-references (profiles, needs,
params keys, tasks, paths) are checked in :mod:`conveyor.spec.project`, the graph in
:mod:`conveyor.plan.dag`. Nothing here imports Prefect, Dask or DVC.
"""

from __future__ import annotations

import difflib
import posixpath
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from conveyor.errors import SpecError, SpecIssue
from conveyor.spec.yamlmap import LoadedYaml

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
TASK_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_bytes(value: str | None) -> str | None:
    if value is not None and value != "auto" and not BYTES.match(value):
        raise ValueError(f"'{value}' is not a size: write it like 4GiB, 512MB or auto")
    return value


class ThreadsProfile(Model):
    """A thread pool in the runner's process: I/O-bound stages (ingest)."""

    kind: Literal["threads"]
    max_workers: PositiveInt = 8


class TlsFiles(Model):
    """TLS files for a scheduler that requires encryption (``tls://`` addresses)."""

    ca_file: str
    cert: str
    key: str | None = None


class DaskProfile(Model):
    """A Dask LocalCluster started for the run, or an existing scheduler (``address``)."""

    kind: Literal["dask"]
    address: str | None = None
    security: TlsFiles | None = None
    n_workers: PositiveInt | None = None
    threads_per_worker: PositiveInt | None = None
    memory_limit: str | None = None
    local_directory: str | None = None
    processes: bool = True

    _bytes = field_validator("memory_limit")(_check_bytes)

    @model_validator(mode="after")
    def _one_kind_of_cluster(self) -> DaskProfile:
        local = [k for k in ("n_workers", "threads_per_worker", "memory_limit", "local_directory")
                 if getattr(self, k) is not None]
        if self.address is not None and local:
            raise ValueError(f"'address' connects to an existing cluster: {', '.join(local)} only apply to "
                             "a LocalCluster started by conveyor; remove one or the other")
        if self.security is not None and self.address is None:
            raise ValueError("'security' applies to an existing cluster: set 'address' too")
        return self


class DaskCudaProfile(Model):
    """A dask-cuda LocalCUDACluster: one worker per visible GPU.

    ``fallback`` says what happens on a machine with no GPU: ``error`` stops the run before
    any stage starts; any other value names the profile to use instead (``cpu`` with no
    profile of that name means a default CPU Dask LocalCluster).
    """

    kind: Literal["dask-cuda"]
    devices: tuple[int, ...] | None = None
    rmm_pool_size: str | None = None
    protocol: Literal["tcp", "ucx", "ucxx"] | None = None
    memory_limit: str | None = None
    fallback: str = "error"

    _bytes = field_validator("memory_limit", "rmm_pool_size")(_check_bytes)


class SlurmProfile(Model):
    """A dask-jobqueue SLURMCluster: Dask workers as Slurm jobs."""

    kind: Literal["slurm"]
    queue: str | None = None
    account: str | None = None
    interface: str | None = None
    cores: PositiveInt = 1
    memory: str = "4GiB"
    walltime: str = "01:00:00"
    jobs: PositiveInt = 1
    processes: PositiveInt | None = None
    job_extra: tuple[str, ...] = ()

    _bytes = field_validator("memory")(_check_bytes)


Profile = Annotated[
    ThreadsProfile | DaskProfile | DaskCudaProfile | SlurmProfile, Field(discriminator="kind")
]
PROFILE_KINDS = ("threads", "dask", "dask-cuda", "slurm")


class Stage(Model):
    """One step of the pipeline: a task, what it reads and writes, and where it runs."""

    task: str
    on: str | None = None
    needs: tuple[str, ...] = ()
    deps: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    retries: Annotated[int, Field(ge=0)] = 0
    retry_delay_s: Annotated[float, Field(ge=0)] = 0.0
    timeout_s: Annotated[float, Field(gt=0)] | None = None
    desc: str | None = None

    @field_validator("deps", "outs", "metrics")
    @classmethod
    def _normalise(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        """``./data/raw/`` and ``data/raw`` are one path (for edges and duplicate outs)."""
        return tuple(p if "://" in p else posixpath.normpath(p) for p in paths)

    @field_validator("task")
    @classmethod
    def _task_ref(cls, value: str) -> str:
        if not TASK_REF.match(value):
            raise ValueError(f"'{value}' is not a task: write it as module:function")
        return value

    @property
    def module(self) -> str:
        return self.task.partition(":")[0]

    @property
    def function(self) -> str:
        return self.task.partition(":")[2]

    @property
    def written(self) -> tuple[str, ...]:
        """Every path this stage writes: outs, then metrics."""
        return self.outs + self.metrics


class Pipeline(Model):
    """A whole spec file."""

    pipeline: str
    params: str = "params.yaml"
    task_packages: tuple[str, ...] = ("tasks",)
    profiles: dict[str, Profile] = Field(default_factory=dict)
    stages: dict[str, Stage]

    @field_validator("stages")
    @classmethod
    def _not_empty(cls, value: dict[str, Stage]) -> dict[str, Stage]:
        if not value:
            raise ValueError("a pipeline needs at least one stage")
        return value


def parse_pipeline(doc: LoadedYaml) -> Pipeline:
    """Validate the structure of a loaded spec; every problem is reported at once."""
    if not isinstance(doc.data, dict):
        raise SpecError([SpecIssue(doc.path, 1, "", "a spec is a mapping with 'pipeline' and 'stages'")])
    issues = [
        SpecIssue(doc.path, doc.line(("stages", name)), f"stages.{name}",
                  "a stage name starts with a letter and holds only letters, digits, _ and -")
        for name in (doc.data.get("stages") or {})
        if not NAME.match(str(name))
    ]
    try:
        pipeline = Pipeline.model_validate(doc.data)
    except ValidationError as exc:
        issues += [_issue(doc, dict(err)) for err in exc.errors()]
        raise SpecError(sorted(issues, key=lambda i: i.line or 0)) from None
    if issues:
        raise SpecError(issues)
    return pipeline


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _issue(doc: LoadedYaml, err: dict[str, Any]) -> SpecIssue:
    loc = _clean_loc(err["loc"], doc.data)
    key = ".".join(str(p) for p in loc)
    line = doc.line(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1], doc.data)
        hint = did_you_mean(str(loc[-1]), allowed)
        listing = f"; allowed: {', '.join(sorted(allowed))}" if not hint else ""
        return SpecIssue(doc.path, line, key, f"unknown key '{loc[-1]}'{hint}{listing}")
    if kind == "union_tag_invalid":
        tag = str(err.get("ctx", {}).get("tag", ""))
        hint = did_you_mean(tag, PROFILE_KINDS)
        return SpecIssue(doc.path, doc.line((*loc, "kind")), f"{key}.kind",
                         f"unknown profile kind '{tag}'{hint}; kinds: {', '.join(PROFILE_KINDS)}")
    if kind == "union_tag_not_found":
        return SpecIssue(doc.path, line, key, f"a profile needs 'kind' ({', '.join(PROFILE_KINDS)})")
    if kind == "missing":
        return SpecIssue(doc.path, line, key, "is required")
    if kind == "value_error":
        return SpecIssue(doc.path, line, key, str(err["msg"]).removeprefix("Value error, "))
    return SpecIssue(doc.path, line, key, f"{err['msg']} (got {err.get('input')!r})")


def _clean_loc(loc: tuple[Any, ...], data: Any) -> tuple[str | int, ...]:
    """Drop pydantic's union-tag segment (``profiles.cpu.dask.x`` → ``profiles.cpu.x``)."""
    parts = list(loc)
    if len(parts) > 2 and parts[0] == "profiles" and parts[2] in PROFILE_KINDS:
        del parts[2]
    return tuple(parts)


def _allowed_keys(parent: tuple[str | int, ...], data: Any) -> list[str]:
    if not parent:
        return list(Pipeline.model_fields)
    if parent[0] == "stages" and len(parent) == 2:
        return list(Stage.model_fields)
    if parent[0] == "profiles" and len(parent) == 2:
        kind = (data.get("profiles") or {}).get(parent[1], {}).get("kind")
        models: dict[str, type[Model]] = {"threads": ThreadsProfile, "dask": DaskProfile,
                                          "dask-cuda": DaskCudaProfile, "slurm": SlurmProfile}
        model = models.get(str(kind))
        return list(model.model_fields) if model else []
    return []
