"""Stages on Dask workers that do not see the project's disk: data moves through the DVC remote.

Before the first stage on a cluster conveyor did not start (``address:``, Slurm), a probe asks
every worker to read a marker file just written under the project root with a fresh random
token (:func:`shares_disk`). Where one cannot, the profile does not share the project's disk:
without a DVC remote the stage fails at once, saying so and what to configure
(:class:`NoSharedDisk`); with one, each stage on it runs in a scratch directory on its worker:

1. the runner stores the stage's deps in the remote by hash (only what it declares; what the
   remote has already is not sent again) and sends the hashes with the stage;
2. on the worker, the deps are checked out of the remote into a fresh scratch directory, the
   command or task runs there as it would in the project, and its outs go into the remote by
   hash; the scratch directory is removed in every case (:func:`in_scratch`);
3. the runner checks the outs out of the remote into place (a draft renamed in), where the
   journal and the record take them up as the outs of a local run.

The hashing and the transfers are DVC's own (:mod:`conveyor.dvc.remote`), so what a worker
wrote is in the remote as ``dvc push`` would have put it.

Checkpoints (:mod:`conveyor.run.checkpoints`) take the same road: what the attempt's folder holds
goes with the deps and is there in the scratch directory; each time the stage marks a new save,
the worker stores a snapshot of the folder in the remote and names its hash to the runner, which
fetches it into the project's folder. A stage stopped there (kill -9 of the runner included)
leaves its latest fetched save for the next attempt.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from conveyor.errors import ProfileError, RemoteDataError
from conveyor.run.checkpoints import PROGRESS, Checkpoint, read_progress
from conveyor.workspace import state_dir

if TYPE_CHECKING:
    from distributed import Client

    from conveyor.dvc.remote import RemoteStore
    from conveyor.run.commands import Command, Sink
    from conveyor.run.profiles import Resources
    from conveyor.spec.project import Project

T = TypeVar("T")
Say = Callable[[str], None]  # a line for the stage's log
PROBE_STEP_S = 1.0  # the probe waits for a first worker in steps this long
RELEASE_POLL_S = 0.5  # how often a stage on a worker looks whether the runner still wants it
SCRATCH_PREFIX = "conveyor-scratch-"
CHECKPOINT = "checkpoint"  # the stream of a worker's lines that names a checkpoint it stored in the remote
CHECKPOINT_POLL_S = 1.0  # how often a worker looks for a new save in the stage's checkpoint folder


class NoSharedDisk(ProfileError):
    """The workers of a profile do not see the project's directory and the project has no DVC remote."""

    def __init__(self, profile: str, root: Path) -> None:
        super().__init__(f"the Dask workers of profile '{profile}' do not see the project's directory "
                         f"{root}: give them a shared disk mounted at that path, or a DVC remote for the data "
                         f"to move through (dvc remote add -d NAME URL, a path or bucket both sides reach)")
        self.profile, self.root = profile, root

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.profile, self.root))


@dataclass(frozen=True)
class Shipment:
    """What travels with a stage to a worker without the project's disk: where the remote is,
    the stage's deps by hash, and the outs to send back."""

    store: RemoteStore
    root: str  # the project root in the runner: paths under it are rewritten to the scratch directory
    deps: Mapping[str, str]  # declared path -> DVC hash
    outs: tuple[str, ...]
    checkpoint: Checkpoint | None = None  # the attempt's checkpoint folder in the runner
    saved: str | None = None  # what it held when the stage left, in the remote (a DVC hash)

    def checkpoint_rel(self) -> str | None:
        """The checkpoint folder relative to the project root (it is under ``.conveyor/``)."""
        return None if self.checkpoint is None else os.path.relpath(self.checkpoint.path, self.root)


def read_marker(path: str, token: str) -> bool:
    """On a worker: whether the marker at ``path`` is there and holds ``token``."""
    try:
        return Path(path).read_text(encoding="utf-8") == token
    except OSError:
        return False


def shares_disk(client: Client, root: Path) -> bool:
    """Whether every worker of ``client`` reads a marker file written now under ``root``. With no
    worker yet (a batch job in the queue), it waits in short steps: the stage's no-worker watch
    (:class:`conveyor.run.workers.WorkerWatch`) bounds that, and Ctrl-C lands between them."""
    token = secrets.token_hex(16)
    marker = state_dir(root) / f"probe-{token[:12]}"
    marker.write_text(token, encoding="utf-8")
    try:
        while True:
            try:
                client.wait_for_workers(1, timeout=PROBE_STEP_S)
                break
            except TimeoutError:
                continue
        seen = client.run(read_marker, str(marker), token, on_error="return")
        return all(answer is True for answer in seen.values())
    finally:
        marker.unlink(missing_ok=True)


class Disks:
    """For one run: which profiles' workers share the project's disk (probed once per profile),
    and the shipments of the stages on those that do not."""

    def __init__(self, project: Project, record: object = None) -> None:
        """``record``: the run's; where it is DVC's, its cache of file hashes spares reading a dep again."""
        self.project = project
        repo = getattr(getattr(record, "inner", record), "repo", None)  # a ForcedRecord wraps DVC's
        self._hashes = getattr(repo, "state", None)
        self._shared: dict[str, bool] = {}
        self._locks: dict[str, threading.Lock] = {}  # one per profile: a probe that waits holds up no other
        self._lock = threading.Lock()
        self._store: RemoteStore | None = None

    def shipment(self, stage: str, resources: Resources, say: Say,
                 checkpoint: Checkpoint | None = None) -> Shipment | None:
        """None where the stage's workers see the project (or there are none); else its deps (and
        what its ``checkpoint`` folder holds), stored in the remote now (``say`` hears how long that
        took). Raises :class:`NoSharedDisk` when there is no remote."""
        if resources.client is None or not (resources.external or resources.ended is not None):
            return None  # a cluster conveyor started here sees what the runner sees
        with self._lock:
            lock = self._locks.setdefault(resources.profile, threading.Lock())
        with lock:
            if resources.profile not in self._shared:
                shared = shares_disk(resources.client, self.project.root)
                with self._lock:
                    self._shared[resources.profile] = shared
                    if not shared and self._store is None:
                        self._store = self._remote()
            if self._shared[resources.profile]:
                return None
            store = self._store
        if store is None:
            raise NoSharedDisk(resources.profile, self.project.root)
        from conveyor.dvc.remote import push

        with timed(say, f"deps stored in DVC remote '{store.name}' ({store.url})"):
            deps = push(store, self.project.root, self._deps(stage), self._hashes)
        shipment = Shipment(store, str(self.project.root), deps, self.project.pipeline.stages[stage].written,
                            checkpoint)
        rel = shipment.checkpoint_rel()
        if checkpoint is None or rel is None or read_progress(checkpoint.path) is None:
            return shipment
        with timed(say, "checkpoint stored in the remote for the worker"):
            return replace(shipment, saved=push(store, self.project.root, [rel]).get(rel))

    def _remote(self) -> RemoteStore | None:
        from conveyor.dvc.remote import default_remote

        return default_remote(self.project.root)

    def _deps(self, stage: str) -> list[str]:
        """What the stage reads: its deps, the params file (a command may read it), persisted outs."""
        from conveyor.plan.fingerprint import data_deps

        spec = self.project.pipeline.stages[stage]
        rels = list(dict.fromkeys([*spec.deps, *data_deps(self.project, stage), *sorted(spec.persist)]))
        params = self.project.params_path
        if spec.params and params.is_file() and params.is_relative_to(self.project.root):
            rels.append(params.relative_to(self.project.root).as_posix())
        return rels

    def receive(self, shipment: Shipment, outs: Mapping[str, str], say: Say) -> None:
        """The outs the worker stored, checked out into place in the project."""
        from conveyor.dvc.remote import materialise

        with timed(say, "outs checked out of the remote"):
            materialise(shipment.store, self.project.root, outs)


def moved(text: str, shipment: Shipment, scratch: Path) -> str:
    """``text`` with the project root (a path, or the start of one) replaced by the scratch directory."""
    root = shipment.root
    if text == root or text.startswith(root + os.sep):
        return str(scratch) + text[len(root):]
    return text


def command_in_scratch(command: Command, shipment: Shipment, scratch: Path) -> Command:
    """The command as it runs in the scratch directory: its working directory and the variables
    naming the project (``DVC_ROOT``, the checkpoint folder) moved there."""
    env = {name: moved(value, shipment, scratch) for name, value in command.env.items()}
    return replace(command, cwd=moved(command.cwd, shipment, scratch), env=env)


def scratch_parent() -> str | None:
    """Where scratch directories go: the worker's own directory (``dask worker --local-directory``),
    which Dask removes when the worker closes and purges when a killed worker's is found; else
    the system's temporary directory."""
    try:
        from distributed import get_worker

        return str(get_worker().local_directory)
    except ValueError:  # not in a worker
        return None


@contextmanager
def timed(say: Say, what: str) -> Iterator[None]:
    """``say`` how long the block took (what moving the data costs, in the stage's log)."""
    began = time.monotonic()
    yield
    say(f"{what} in {time.monotonic() - began:.1f}s")


def run_in_scratch(shipment: Shipment, work: Callable[[Path], T], say: Say,
                   succeeded: Callable[[T], bool] = lambda _result: True,
                   stored: Callable[[str], None] = lambda _hash: None) -> tuple[T, dict[str, str]]:
    """On a worker: a scratch directory holding the stage's deps, ``work(scratch)`` there, then
    its outs stored in the remote (only when it ``succeeded``); returns its result and the outs'
    hashes. Each new save in the stage's checkpoint folder is stored too, its hash told to
    ``stored``. The directory is removed in every case, an exception or a cancel included."""
    from conveyor.dvc.remote import materialise, push

    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=scratch_parent()))
    try:
        with timed(say, f"deps checked out into {scratch} on the worker"):
            materialise(shipment.store, scratch, shipment.deps, linked=True)
        rel = shipment.checkpoint_rel()
        if rel is not None and shipment.saved:
            materialise(shipment.store, scratch, {rel: shipment.saved})
        with _sending_saves(shipment.store, None if rel is None else scratch / rel, stored):
            result = work(scratch)
        if not succeeded(result):
            return result, {}
        with timed(say, "outs stored in the remote from the worker"):
            return result, push(shipment.store, scratch, shipment.outs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _sending_saves(store: RemoteStore, folder: Path | None, stored: Callable[[str], None]) -> Iterator[None]:
    """On a worker, around a stage: every :data:`CHECKPOINT_POLL_S`, and once at the end, a save
    marked in ``folder`` since the last look goes to the remote (:func:`_store_save`)."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    last: list[tuple[int, int] | None] = [None]

    def look() -> bool:
        last[0] = _store_save(store, folder, last[0], stored)
        return False

    try:
        with _every(CHECKPOINT_POLL_S, look, "conveyor-checkpoints"):
            yield
    finally:
        look()  # what the stage saved last, even as it failed


def _store_save(store: RemoteStore, folder: Path, last: tuple[int, int] | None,
                stored: Callable[[str], None]) -> tuple[int, int] | None:
    """Store the save ``folder``'s progress file names, when it is not ``last``: a snapshot of hard
    links first, taken between two saves (each file of a save is written whole and renamed in,
    the progress file after them), so a save under way is never half stored. Returns the stamp of
    the save stored, ``last`` when there was none or the stage saved again meanwhile."""
    from conveyor.dvc.remote import push

    def stamp() -> tuple[int, int] | None:
        try:
            info = (folder / PROGRESS).stat()
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_mtime_ns

    now = stamp()
    if now is None or now == last:
        return last
    snapshot = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.snapshot")
    try:
        shutil.copytree(folder, snapshot, copy_function=os.link, ignore=shutil.ignore_patterns(".*.tmp"))
        if stamp() != now:
            return last
        value = push(store, snapshot.parent, [snapshot.name]).get(snapshot.name)
    except (OSError, shutil.Error, RemoteDataError):  # a save removed a file under the snapshot: the next look
        return last
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    if value:
        stored(value)
    return now


@contextmanager
def saves_fetched(shipment: Shipment | None, sink: Sink) -> Iterator[Sink]:
    """The runner's side: ``sink`` for a stage's lines from a worker, the ones naming a save it
    stored fetched into the project's checkpoint folder (in a thread of their own: the lines
    arrive on Dask's event loop). At the end, the last one named is fetched before it returns."""
    rel = shipment.checkpoint_rel() if shipment is not None else None
    if shipment is None or rel is None:
        yield sink
        return
    from conveyor.dvc.remote import materialise

    latest: list[str | None] = [None]
    wake, closing = threading.Condition(), threading.Event()

    def fetch() -> None:
        while True:
            with wake:
                wake.wait_for(lambda: latest[0] is not None or closing.is_set())
                value, latest[0] = latest[0], None
            if value is None:
                return
            try:
                materialise(shipment.store, Path(shipment.root), {rel: value})
            except RemoteDataError as exc:
                sink("log", f"a checkpoint the worker stored could not be fetched: {exc}")
                continue
            progress = read_progress(Path(shipment.root) / rel)
            sink("log", f"checkpoint at {progress.where() if progress else 'an unknown step'} fetched from the "
                        "worker through the remote")

    def receive(stream: str, line: str) -> None:
        if stream != CHECKPOINT:
            sink(stream, line)
            return
        with wake:
            latest[0] = line
            wake.notify()

    fetcher = threading.Thread(target=fetch, name="conveyor-checkpoint-fetch", daemon=True)
    fetcher.start()
    try:
        yield receive
    finally:
        with wake:
            closing.set()
            wake.notify()
        fetcher.join()


class Released(Exception):
    """Raised into a task stage's thread on a worker once the runner no longer wants it (no arguments)."""


@contextmanager
def stopped_when_released(stop: Callable[[], object]) -> Iterator[None]:
    """On a worker, around a stage: ``stop()`` once the scheduler no longer wants this Dask task.

    Dask lets a task that is running go on when its client lets go of it: after Ctrl-C (the
    runner cancels it) and after kill -9 of the runner (the scheduler drops a client whose
    connection closed). Nothing else would end a command or a task there, nor remove its
    scratch directory; this watch does, within :data:`RELEASE_POLL_S`.
    """
    from distributed import get_worker

    worker = get_worker()
    key = worker.get_current_task()

    def released() -> bool:
        task = worker.state.tasks.get(key)
        if task is None or task.state in ("cancelled", "released", "forgotten"):
            stop()
            return True
        return False

    with _every(RELEASE_POLL_S, released, "conveyor-released"):
        yield


@contextmanager
def _every(period_s: float, step: Callable[[], bool], name: str) -> Iterator[None]:
    """``step()`` every ``period_s`` in a thread of its own while the block runs, until it returns True."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(period_s):
            if step():
                return

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
