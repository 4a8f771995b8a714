"""Compute profiles: where a stage runs. One small class per kind, one interface.

A :class:`Profiles` set belongs to one run: each profile starts on first use (a stage on
it is about to run), is shared by every stage on it, and is closed when the run ends,
also on failure and Ctrl-C, so no Dask worker outlives the run. Heavy imports
(distributed, dask_cuda, dask_jobqueue) happen inside ``start``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from conveyor.errors import ProfileError, UsageError
from conveyor.run.nanny_env import undo_nanny_environ, worker_environ
from conveyor.run.record import IN_PROCESS
from conveyor.run.slurm import SlurmJobs, slurm_cluster
from conveyor.spec.base import size_in_bytes
from conveyor.spec.profiles import DaskCudaProfile, DaskProfile, Profile, SlurmProfile, ThreadsProfile

if TYPE_CHECKING:
    from distributed import Client

log = logging.getLogger("conveyor.profiles")
# one profile starts at a time: distributed imports parts of itself as a cluster starts, and two
# clusters starting in two threads at once failed with "module 'distributed.dashboard' has no
# attribute 'scheduler'" (an import seen half done)
_STARTING = threading.Lock()


@dataclass(frozen=True)
class Resources:
    """What a started profile gives the stages on it (the compute part of StageContext)."""

    profile: str
    client: Client | None = None
    executor: Executor | None = None
    n_workers: int = 1
    devices: tuple[int, ...] = ()
    memory_limit: str | None = None  # of each Dask worker, as the profile says it
    external: bool = False  # a cluster conveyor did not start (``address:``): never restarted
    no_workers_timeout_s: float | None = None  # a stage fails after this long with no worker (None: waits)
    # why the profile's workers are gone for good ("" while they may still come): a batch system's word
    ended: Callable[[], str] | None = None


LOCAL = Resources(profile="local")


@dataclass(frozen=True)
class Placement:
    """Where a stage runs on its profile: on the profile's workers, or in the runner's process
    because its deps are smaller than the profile's ``in_process_below`` (say why, either way)."""

    in_process: bool = False
    why: str = ""  # empty for a profile without in_process_below: its workers, as always


def deps_bytes(paths: Iterable[Path], stop_above: int) -> int:
    """Bytes held by the files at and under ``paths``; counting stops once past ``stop_above``
    (a dep of a million files is not walked to the end to learn that it is big)."""
    total = 0
    for path in paths:
        for root, _dirs, files in os.walk(path) if path.is_dir() else [(str(path.parent), [], [path.name])]:
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:  # a dangling link, or gone since listed: holds nothing to read
                    continue
                if total > stop_above:
                    return total
    return total


def _size(n: int) -> str:
    """``512 B``, ``84.2 KiB``, ``1.3 GiB``: a size as a person reads it."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def visible_gpus() -> tuple[int, ...]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return tuple(range(len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])))
    return _machine_gpus()


@functools.cache
def _machine_gpus() -> tuple[int, ...]:
    """The GPUs nvidia-smi lists, asked once per process (it takes tens of milliseconds)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(int(line) for line in out.split() if line.strip().isdigit())


def _start_threads(name: str, profile: ThreadsProfile, stack: ExitStack) -> Resources:
    pool = ThreadPoolExecutor(max_workers=profile.max_workers, thread_name_prefix=f"conveyor-{name}")
    stack.callback(pool.shutdown, wait=True, cancel_futures=True)
    return Resources(profile=name, executor=pool, n_workers=profile.max_workers)


def _client(cluster: Any, stack: ExitStack) -> Client:
    from distributed import Client

    client: Client = stack.enter_context(Client(cluster, set_as_default=False))
    return client


def _n_workers(client: Client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


def _security(profile: DaskProfile) -> Any:
    """distributed's Security for a TLS scheduler, or None for plain TCP."""
    if profile.security is None:
        return None
    from distributed.security import Security

    tls = profile.security
    return Security(tls_ca_file=tls.ca_file, tls_client_cert=tls.cert, tls_client_key=tls.key,
                    require_encryption=True)


def _start_dask(name: str, profile: DaskProfile, stack: ExitStack) -> Resources:
    from distributed import Client, LocalCluster

    if profile.address is not None:
        try:
            client = stack.enter_context(Client(profile.address, set_as_default=False, timeout="30s",
                                                security=_security(profile)))
        except (OSError, TypeError, ValueError) as exc:  # TypeError: a TLS scheduler, no TLS context
            hint = " (a tls:// scheduler needs 'security: {ca_file, cert, key}' or Dask's TLS config)" \
                if profile.address.startswith("tls://") and profile.security is None else ""
            raise ProfileError(f"profile '{name}': cannot connect to the Dask scheduler at "
                               f"{profile.address}: {exc}{hint}") from exc
        return Resources(profile=name, client=client, n_workers=_n_workers(client), external=True,
                         no_workers_timeout_s=profile.no_workers_timeout_s)
    options: dict[str, Any] = {
        "n_workers": profile.n_workers, "threads_per_worker": profile.threads_per_worker,
        "processes": profile.processes, "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
    }
    if profile.memory_limit is not None:
        options["memory_limit"] = profile.memory_limit
    if profile.local_directory is not None:
        options["local_directory"] = profile.local_directory
    if profile.resources:
        options["resources"] = dict(profile.resources)  # each worker's, as dask worker --resources
    # its nannies, here, set OMP_NUM_THREADS=1 &c. on os.environ: not ours to keep
    with worker_environ(profile.worker_env), undo_nanny_environ():
        cluster = stack.enter_context(LocalCluster(**options))
        client = _client(cluster, stack)
    return Resources(profile=name, client=client, n_workers=_n_workers(client), memory_limit=profile.memory_limit,
                     no_workers_timeout_s=profile.no_workers_timeout_s)


def _start_dask_cuda(name: str, profile: DaskCudaProfile, stack: ExitStack) -> Resources:
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise ProfileError(f"profile '{name}' needs dask-cuda: pip install 'conveyor[gpu]' ({exc})") from exc
    options: dict[str, Any] = {"protocol": profile.protocol, "rmm_pool_size": profile.rmm_pool_size,
                               "dashboard_address": "127.0.0.1:0",
                               "resources": {"GPU": 1}}  # one worker per GPU: stages' resources hold them
    if profile.devices is not None:
        options["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, profile.devices))
    if profile.memory_limit is not None:
        options["memory_limit"] = profile.memory_limit
    with undo_nanny_environ():  # as for a LocalCluster: its nannies run here
        cluster = stack.enter_context(LocalCUDACluster(**{k: v for k, v in options.items() if v is not None}))
        client = _client(cluster, stack)
    devices = profile.devices if profile.devices is not None else visible_gpus()
    return Resources(profile=name, client=client, n_workers=_n_workers(client), devices=tuple(devices),
                     memory_limit=profile.memory_limit)


def _start_slurm(name: str, profile: SlurmProfile, stack: ExitStack) -> Resources:
    cluster = stack.enter_context(slurm_cluster(name, profile))
    cluster.scale(jobs=profile.jobs)
    jobs = SlurmJobs(name, profile, cluster)
    jobs.wait_submitted(profile.jobs)
    client = _client(cluster, stack)
    return Resources(profile=name, client=client, n_workers=profile.jobs * (profile.processes or 1),
                     ended=jobs.ended)


class Profiles(AbstractContextManager["Profiles"]):
    """The profiles of one run, started lazily and closed together."""

    def __init__(self, profiles: Mapping[str, Profile], overrides: Mapping[str, str] | None = None) -> None:
        self._profiles = dict(profiles)
        self._overrides = dict(overrides or {})
        for old, new in self._overrides.items():
            for name in (old, new):
                if name not in self._profiles:
                    raise UsageError(f"--profile {old}={new}: unknown profile '{name}' "
                                     f"(profiles: {', '.join(self._profiles) or 'none'})")
        self._started: dict[str, Resources] = {}
        self._locks: dict[str, threading.Lock] = {n: threading.Lock() for n in [*self._profiles, "cpu"]}
        self._stack = ExitStack()

    def resolve(self, name: str | None) -> str | None:
        """The profile a stage declared as ``name`` runs on: overrides and GPU fallbacks applied."""
        if name is None:
            return None
        name = self._overrides.get(name, name)
        profile = self._profiles[name]
        if isinstance(profile, DaskCudaProfile) and not visible_gpus():
            if profile.fallback == "error":
                raise ProfileError(f"profile '{name}' needs a GPU and none is visible; set "
                                   f"'fallback: cpu' or run with --profile {name}=<cpu profile>")
            return profile.fallback
        return name

    def check(self, names: set[str | None]) -> list[str]:
        """Fail before any stage starts when a profile cannot be used; returns warnings."""
        warnings = []
        for name in sorted(n for n in names if n is not None):
            target = self.resolve(name)
            if target != self._overrides.get(name, name):
                warnings.append(f"no GPU visible: profile '{name}' falls back to '{target}' (CPU)")
        return warnings

    def place(self, name: str | None, deps: Iterable[Path]) -> Placement:
        """In the runner's process when the stage's ``deps`` hold fewer bytes than its profile's
        ``in_process_below``: for small inputs a cluster costs more (starting it, shipping the data,
        scheduling tasks) than the work. Decided from file sizes only, before the profile starts."""
        target = self.resolve(name)
        profile = self._profiles.get(target) if target is not None else None
        if not isinstance(profile, DaskProfile | SlurmProfile) or profile.in_process_below is None:
            return Placement()
        limit = size_in_bytes(profile.in_process_below)
        held = deps_bytes(deps, stop_above=limit)
        if held < limit:
            return Placement(True, f"{IN_PROCESS}: its deps hold {_size(held)}, under the in_process_below "
                                   f"of profile '{target}' ({profile.in_process_below})")
        return Placement(False, f"on the workers of profile '{target}': its deps hold at least its "
                                f"in_process_below ({profile.in_process_below})")

    def in_process(self, name: str | None) -> Resources:
        """What a stage placed in the runner's process gets: no client, no executor; dask
        collections compute on dask's local scheduler in this process."""
        return Resources(profile=self.resolve(name) or "local")

    def get(self, name: str | None) -> Resources:
        """The started profile for a stage's ``on:`` (None: in the runner's own process)."""
        target = self.resolve(name)
        if target is None:
            return LOCAL
        with self._locks.setdefault(target, threading.Lock()):
            if target not in self._started:
                with _STARTING:
                    self._started[target] = self._start(target)
            return self._started[target]

    def _start(self, name: str) -> Resources:
        profile = self._profiles.get(name) or DaskProfile(kind="dask")  # 'cpu' fallback default
        log.info("starting profile '%s' (%s)", name, profile.kind)
        if isinstance(profile, ThreadsProfile):
            return _start_threads(name, profile, self._stack)
        if isinstance(profile, DaskProfile):
            return _start_dask(name, profile, self._stack)
        if isinstance(profile, DaskCudaProfile):
            return _start_dask_cuda(name, profile, self._stack)
        return _start_slurm(name, profile, self._stack)

    def close(self) -> None:
        self._stack.close()
        self._started.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
