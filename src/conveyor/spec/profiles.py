"""Profiles: where stages run (threads, a Dask cluster, dask-cuda, Slurm), as frozen pydantic models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from conveyor.spec.base import ENV_NAME, Model, check_bytes, check_size


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
    # what each worker of the LocalCluster declares, as `dask worker --resources` ({GPU: 1}): stages
    # with resources hold such workers (an existing cluster's workers declare their own)
    resources: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")],
                    Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = None

    _bytes = field_validator("memory_limit")(check_bytes)
    _size = field_validator("in_process_below")(check_size)

    @field_validator("worker_env")
    @classmethod
    def _env_names(cls, value: dict[str, str | int | None] | None) -> dict[str, str | int | None] | None:
        bad = [name for name in value or {} if not ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not an environment variable name (letters, digits, _)")
        return value

    @model_validator(mode="after")
    def _one_kind_of_cluster(self) -> DaskProfile:
        local = [k for k in ("n_workers", "threads_per_worker", "memory_limit", "local_directory", "worker_env",
                             "resources") if getattr(self, k) is not None]
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

    _bytes = field_validator("memory_limit", "rmm_pool_size")(check_bytes)


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
    # what each worker declares ({GPU: 1} with job_extra: ["--gres=gpu:1"]): stages' resources hold them
    resources: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")],
                    Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = None

    _bytes = field_validator("memory")(check_bytes)
    _size = field_validator("in_process_below")(check_size)


Profile = Annotated[
    ThreadsProfile | DaskProfile | DaskCudaProfile | SlurmProfile, Field(discriminator="kind")
]
PROFILE_KINDS = ("threads", "dask", "dask-cuda", "slurm")
