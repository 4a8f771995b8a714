"""The pipeline spec of SPEC.md section 2, as frozen pydantic models.

Pure data: parsing and structural validation only. Cross-references (profiles, needs,
params keys, tasks, paths) are checked in :mod:`conveyor.spec.project`, the graph in
:mod:`conveyor.plan.dag`. Nothing here imports Prefect, Dask or DVC.
"""

from __future__ import annotations

import difflib
import posixpath
import re
import reprlib
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.errors import SpecError, SpecIssue
from conveyor.spec.yamlmap import LoadedYaml

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TASK_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_bytes(value: str | None) -> str | None:
    if value is not None and value != "auto" and not BYTES.match(value):
        raise ValueError(f"'{value}' is not a size: write it like 4GiB, 512MB or auto")
    return value


def _check_size(value: str | None) -> str | None:
    if value is not None and not BYTES.match(value):
        raise ValueError(f"'{value}' is not a size: write it like 64MiB or 500KB")
    return value


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(text: str) -> int:
    """``64MiB`` -> 67108864, as Dask reads sizes (``MB`` is 10**6, ``MiB`` 2**20)."""
    match = BYTES.match(text)
    if match is None:
        raise ValueError(f"'{text}' is not a size")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


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
    # a stage whose deps hold fewer bytes runs in the runner's process, no cluster started for it
    in_process_below: str | None = None
    # environment of the workers, set before each starts (what glibc's malloc and OpenMP read), over
    # Dask's distributed.nanny.pre-spawn-environ; null removes one of Dask's
    worker_env: dict[str, str | int | None] | None = None
    # a running stage fails once its scheduler has had no worker this long (all of them killed,
    # or none ever came); null: wait for workers as long as it takes
    no_workers_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = 60.0

    _bytes = field_validator("memory_limit")(_check_bytes)
    _size = field_validator("in_process_below")(_check_size)

    @field_validator("worker_env")
    @classmethod
    def _env_names(cls, value: dict[str, str | int | None] | None) -> dict[str, str | int | None] | None:
        bad = [name for name in value or {} if not ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not an environment variable name (letters, digits, _)")
        return value

    @model_validator(mode="after")
    def _one_kind_of_cluster(self) -> DaskProfile:
        local = [k for k in ("n_workers", "threads_per_worker", "memory_limit", "local_directory", "worker_env")
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
    in_process_below: str | None = None  # as a dask profile's: small stages submit no job

    _bytes = field_validator("memory")(_check_bytes)
    _size = field_validator("in_process_below")(_check_size)


Profile = Annotated[
    ThreadsProfile | DaskProfile | DaskCudaProfile | SlurmProfile, Field(discriminator="kind")
]
PROFILE_KINDS = ("threads", "dask", "dask-cuda", "slurm")


def _normalised(path: str) -> str:
    """``./data/raw/`` and ``data/raw`` are one path (for edges and duplicate outs)."""
    return path if "://" in path else posixpath.normpath(path)


class Declared(Model):
    """One path a stage declares: as written (normalised), its name if it has one, and
    ``persist`` (outs only: left in place while the stage runs, as in DVC)."""

    path: str
    name: str | None = None
    persist: bool = False

    _path = field_validator("path")(_normalised)


def _declared(value: Any, *, outs: bool) -> Any:
    """The forms a stage may write its paths in, as :class:`Declared` items.

    A list of paths (``[data/raw]``), where an out may carry DVC's options
    (``- models/ckpt: {persist: true}``); or a mapping from names to paths
    (``{data: data/processed, model: models/xgb.json}``), where a task finds each by name.
    """
    if isinstance(value, Mapping):
        return [_named(str(name), body, outs=outs) for name, body in value.items()]
    if not isinstance(value, list | tuple):
        return value  # pydantic names the type it expected
    items: list[Any] = []
    for item in value:
        if outs and isinstance(item, Mapping) and len(item) == 1:
            ((path, options),) = item.items()
            if options is not None and not isinstance(options, Mapping):
                raise ValueError(f"'{path}': options of an out are a mapping, e.g. {{persist: true}}")
            items.append({"path": path, **(options or {})})
        else:
            items.append({"path": item} if isinstance(item, str) else item)
    return items


def _named(name: str, body: Any, *, outs: bool) -> Any:
    if not NAME.match(name):
        raise ValueError(f"'{name}' is not a name: start with a letter; letters, digits, _ and - only")
    if isinstance(body, str):
        return {"path": body, "name": name}
    if outs and isinstance(body, Mapping):
        return {**body, "name": name}
    raise ValueError(f"'{name}' must be a path" + (" or {path: ..., persist: true}" if outs else ""))


# A duration: finite (``.inf`` would overflow the timers it is given to; no timeout is no key)
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Deps = Annotated[tuple[Declared, ...], BeforeValidator(partial(_declared, outs=False))]
Outs = Annotated[tuple[Declared, ...], BeforeValidator(partial(_declared, outs=True))]


class Stage(Model):
    """One step of the pipeline: a task or a command, what it reads and writes, where it runs.

    ``deps``, ``outs`` and ``metrics`` are read as paths (tuples of strings); each may be
    written as a list or as a mapping of names to paths (:func:`_declared`).
    """

    task: str | None = None
    cmd: str | tuple[str, ...] | None = None
    wdir: str | None = None
    on: str | None = None
    needs: tuple[str, ...] = ()
    dep_items: Deps = Field(default=(), alias="deps")
    params: tuple[str, ...] = ()
    out_items: Outs = Field(default=(), alias="outs")
    metric_items: Outs = Field(default=(), alias="metrics")
    retries: Annotated[int, Field(ge=0)] = 0
    retry_delay_s: Seconds = 0.0
    timeout_s: PositiveSeconds | None = None
    # the same bytes on any x86-64 CPU: pinned kernel paths and one thread (conveyor.run.determinism)
    deterministic: bool = False
    desc: str | None = None

    @field_validator("task")
    @classmethod
    def _task_ref(cls, value: str | None) -> str | None:
        if value is not None and not TASK_REF.match(value):
            raise ValueError(f"'{value}' is not a task: write it as module:function")
        return value

    @field_validator("cmd")
    @classmethod
    def _some_command(cls, value: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if value is None:
            return None
        commands = (value,) if isinstance(value, str) else value
        if not commands or not all(c.strip() for c in commands):
            raise ValueError("an empty command: write the shell command to run")
        return value

    @model_validator(mode="after")
    def _task_or_cmd(self) -> Stage:
        if (self.task is None) == (self.cmd is None):
            raise ValueError("a stage runs a task (module:function) or a cmd (a shell command): give exactly one")
        if self.wdir is not None and self.cmd is None:
            raise ValueError("'wdir' is where a cmd runs: a task stage has none")
        names = [i.name for i in self.dep_items + self.out_items + self.metric_items if i.name is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"the name {', '.join(map(repr, twice))} is given to more than one path of "
                             "deps, outs and metrics: a name finds one path")
        return self

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.dep_items)

    @property
    def outs(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.out_items)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.metric_items)

    @property
    def written(self) -> tuple[str, ...]:
        """Every path this stage writes: outs, then metrics."""
        return self.outs + self.metrics

    @property
    def persist(self) -> frozenset[str]:
        """Outs left in place while the stage runs (``persist: true``)."""
        return frozenset(i.path for i in self.out_items + self.metric_items if i.persist)

    @property
    def names(self) -> dict[str, str]:
        """Named deps, outs and metrics: name -> path (a task finds them by name)."""
        return {i.name: i.path for i in self.dep_items + self.out_items + self.metric_items if i.name is not None}

    @property
    def commands(self) -> tuple[str, ...]:
        """A cmd stage's commands, run one after another (a list ``cmd``, as in DVC)."""
        return (self.cmd,) if isinstance(self.cmd, str) else tuple(self.cmd or ())

    @property
    def module(self) -> str:
        return (self.task or "").partition(":")[0]

    @property
    def function(self) -> str:
        return (self.task or "").partition(":")[2]


class ModelSpec(Model):
    """How the project's model predicts (SPEC.md §2.4): ``conveyor predict`` and ``serve-model``.

    ``files`` name the outs that make up the model (its version is their hash); ``features``
    the input columns, in order: a list, or ``FILE:KEY`` (a JSON list in one of those files).
    ``load(files) -> model`` runs once per version; ``predict(model, rows) -> scores``, one per row
    (without ``load`` it gets the files, name -> path).
    """

    files: dict[str, str]
    features: str | tuple[str, ...]
    predict: str
    load: str | None = None
    id: str | None = None  # the input's id column, copied to the scores predict writes
    registry: str = "models/registry.json"  # where retraining records the champion

    @field_validator("files")
    @classmethod
    def _some_files(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("name the outs that make up the model (name: path)")
        bad = [n for n in value if not NAME.match(n)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: a name starts with a letter and holds only letters, "
                             "digits, _ and -")
        return value

    @field_validator("predict", "load")
    @classmethod
    def _function_ref(cls, value: str | None) -> str | None:
        if value is not None and not TASK_REF.match(value):
            raise ValueError(f"'{value}' is not a function: write it as module:function")
        return value

    @model_validator(mode="after")
    def _features_known(self) -> ModelSpec:
        if isinstance(self.features, str):
            path, sep, key = self.features.rpartition(":")
            if not sep or not key or path not in self.files.values():
                raise ValueError(f"features '{self.features}': give the columns as a list, or as FILE:KEY "
                                 f"where FILE is one of the model's files ({', '.join(self.files.values())})")
        elif not self.features or len(set(self.features)) != len(self.features):
            raise ValueError("features: the input columns, each once")
        return self


class Pipeline(Model):
    """A whole spec file."""

    pipeline: str
    params: str = "params.yaml"
    task_packages: tuple[str, ...] = ("tasks",)
    profiles: dict[str, Profile] = Field(default_factory=dict)
    stages: dict[str, Stage]
    model: ModelSpec | None = None

    @field_validator("stages")
    @classmethod
    def _not_empty(cls, value: dict[str, Stage]) -> dict[str, Stage]:
        if not value:
            raise ValueError("a pipeline needs at least one stage")
        return value


class Placement(Model):
    """Where the stages a glob matches run, and how they retry (a dvc.yaml's stages)."""

    on: str | None = None
    retries: Annotated[int, Field(ge=0)] | None = None
    retry_delay_s: Seconds | None = None
    timeout_s: PositiveSeconds | None = None
    deterministic: bool | None = None


class DvcPipeline(Model):
    """A spec that runs an existing dvc.yaml as it is, adding only where its stages run.

    ``placement`` maps stage-name globs (``train@*``) to a :class:`Placement`; every glob
    that matches a stage applies, later ones overriding earlier ones key by key.
    """

    pipeline: str | None = None
    dvc: str = "dvc.yaml"
    profiles: dict[str, Profile] = Field(default_factory=dict)
    placement: dict[str, Placement] = Field(default_factory=dict)
    model: ModelSpec | None = None  # what predict and serve-model score with (SPEC.md §2.4)


def parse_dvc_pipeline(doc: LoadedYaml) -> DvcPipeline:
    """Validate a placement spec (``dvc: dvc.yaml``); every problem is reported at once."""
    try:
        return DvcPipeline.model_validate(doc.data)
    except ValidationError as exc:
        issues = [_issue(doc, dict(err)) for err in exc.errors()]
        raise SpecError(sorted(issues, key=lambda i: i.line or 0)) from None


# a file name holds 255 bytes (NAME_MAX): a stage's journal entry is `.NAME-xxxxxxxx.done` while it is dropped
MAX_NAME = 255 - len(".-xxxxxxxx.done")


def parse_pipeline(doc: LoadedYaml, items: Iterable[str] = ()) -> Pipeline:
    """Validate the structure of a loaded spec; every problem is reported at once.

    ``items``: stage names a matrix made (``train@0.1-6``), whose group name is checked instead.
    """
    if not isinstance(doc.data, dict):
        raise SpecError([SpecIssue(doc.path, 1, "", "a spec is a mapping with 'pipeline' and 'stages'")])
    stages = doc.data.get("stages")
    made = frozenset(items)
    issues = [
        SpecIssue(doc.path, doc.line(("stages", name)), f"stages.{name}",
                  "a stage name starts with a letter and holds only letters, digits, _ and -")
        for name in (stages if isinstance(stages, dict) else {})
        if not NAME.match(str(name).partition("@")[0] if name in made else str(name))
    ]
    issues += [
        SpecIssue(doc.path, doc.line(("stages", name)) or doc.line(("stages", str(name).partition("@")[0])),
                  f"stages.{name}", f"a stage name of {len(str(name).encode())} bytes is too long: a run names "
                  f"the stage's log file and journal entry after it, which leaves at most {MAX_NAME} bytes"
                  + ("; shorten the matrix's values or its name" if name in made else ""))
        for name in (stages if isinstance(stages, dict) else {}) if len(str(name).encode()) > MAX_NAME
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
    return SpecIssue(doc.path, line, key, f"{err['msg']} (got {_PREVIEW.repr(err.get('input'))})")


# What a message shows of a wrong value: all of a small one, the start of a big one (a list of
# 50,000 items, a string of a megabyte) so that each problem stays one readable line.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxstring = _PREVIEW.maxother = 80
_PREVIEW.maxlist = _PREVIEW.maxtuple = _PREVIEW.maxset = 8
_PREVIEW.maxdict = 4


def _clean_loc(loc: tuple[Any, ...], data: Any) -> tuple[str | int, ...]:
    """Drop pydantic's union-tag segment (``profiles.cpu.dask.x`` → ``profiles.cpu.x``)."""
    parts = list(loc)
    if len(parts) > 2 and parts[0] == "profiles" and parts[2] in PROFILE_KINDS:
        del parts[2]
    return tuple(parts)


def _allowed_keys(parent: tuple[str | int, ...], data: Any) -> list[str]:
    if not parent:
        return list(DvcPipeline.model_fields if "dvc" in data else Pipeline.model_fields)
    if parent[0] == "placement" and len(parent) == 2:
        return list(Placement.model_fields)
    if parent == ("model",):
        return list(ModelSpec.model_fields)
    if parent[0] == "stages" and len(parent) == 2:
        written = [field.alias or name for name, field in Stage.model_fields.items()]
        return written if "@" in str(parent[1]) else [*written, "matrix"]  # an item's matrix is spent
    if parent[0] == "stages" and len(parent) == 4 and parent[2] in ("outs", "metrics"):
        return ["persist"]
    if parent[0] == "profiles" and len(parent) == 2:
        kind = (data.get("profiles") or {}).get(parent[1], {}).get("kind")
        models: dict[str, type[Model]] = {"threads": ThreadsProfile, "dask": DaskProfile,
                                          "dask-cuda": DaskCudaProfile, "slurm": SlurmProfile}
        model = models.get(str(kind))
        return list(model.model_fields) if model else []
    return []
