"""``conveyor predict``: score a large file partition by partition on a Dask "swarm".

The input (parquet or CSV, a path, glob or fsspec URL) is read lazily with
``dask.dataframe`` in partitions of ``blocksize``; each worker loads the model once and
scores the partitions it is given; the client writes the scores, in input order, into one
parquet file (the id column, or the row number, and ``score``) beside the output, and
renames it into place when every partition is done. A failed or interrupted job leaves
the previous output as it was. The cluster is started for the job and closed after it,
or is a profile of the spec (an existing scheduler: ``address:``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError, UsageError, redact
from conveyor.predict.model import ModelError, ModelVersion, Scorer, load_scorer, model_spec, resolve
from conveyor.spec.models import ModelSpec
from conveyor.spec.profiles import DaskProfile

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd

    from conveyor.spec.project import Project

ROW = "row"  # the output's key column when the model declares no id column
SCORE = "score"
SWARM = "swarm"  # the profile name of the cluster started for the job
PARQUET = (".parquet", ".pq", ".parq")
Progress = Callable[[int, int], None]  # (partitions done, partitions)


@dataclass(frozen=True)
class Job:
    """A checked request: what to score with which model, and where the scores go."""

    model: ModelVersion
    spec: ModelSpec
    source: str
    output: Path
    key: str  # the id column copied to the output, or ROW
    columns: tuple[str, ...]  # of the input, as read


@dataclass(frozen=True)
class Scored:
    rows: int
    partitions: int
    workers: int
    wall_s: float
    output: Path
    model: ModelVersion
    key: str


def plan(project: Project, which: str, source: str, output: Path, *, id_column: str | None = None,
         allow_extra: bool = False, blocksize: str = "64MiB") -> tuple[Job, dd.DataFrame]:
    """Check the request before any worker starts: the model, the output's place, the input's columns."""
    spec = model_spec(project)
    model = resolve(project, which)
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory: name the parquet file to write (e.g. scores.parquet)")
    if not output.parent.is_dir():
        raise UsageError(f"--output {output}: the directory {output.parent} does not exist")
    frame = read(source, model.features, blocksize)
    key = id_column or spec.id
    columns = tuple(str(c) for c in frame.columns)
    problems = []
    missing = [f for f in model.features if f not in columns]
    if missing:
        problems.append(f"missing the model's feature column{'s' if len(missing) > 1 else ''} {_listed(missing)}")
    if key is not None and key not in columns:
        problems.append(f"no id column '{key}' (the model's id; --id names another)")
    extra = [c for c in columns if c not in model.features and c != key]
    if extra and not allow_extra:
        problems.append(f"{'columns' if len(extra) > 1 else 'a column'} the model does not read: {_listed(extra)} "
                        "(--allow-extra ignores them)")
    if problems:
        raise UsageError(f"--input {redact(source)} does not match model {model.version} "
                         f"({len(model.features)} features): {'; '.join(problems)}")
    return Job(model, spec, source, output, key or ROW, columns), frame


def _listed(names: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def read(source: str, features: Sequence[str], blocksize: str) -> dd.DataFrame:
    """The input as a lazy dask DataFrame: parquet (by extension or a directory), else CSV.

    Parquet pages are verified against their checksums where a worker reads them: a damaged
    page fails the job with a :class:`~conveyor.errors.DamagedFileError` naming the file."""
    import dask.dataframe as dd

    from conveyor.parquet import read_dask

    path = source.split("://", 1)[-1].rstrip("/")
    parquet = path.lower().endswith(PARQUET) or ("://" not in source and Path(source).is_dir())
    if "://" not in source and not any(c in source for c in "*?[") and not Path(source).exists():
        raise UsageError(f"--input {source}: no such file or directory; give a parquet or CSV path, glob or URL")
    try:
        if parquet:
            frame: dd.DataFrame = read_dask(source, blocksize=blocksize)
        else:
            frame = dd.read_csv(source, blocksize=blocksize, dtype=dict.fromkeys(features, "float64"))
    except (OSError, ValueError, TypeError, IndexError) as exc:
        original = exc.__cause__ if type(exc.__cause__) is type(exc) else exc  # what dask's dispatch wrapped
        what, why = "parquet" if parquet else "CSV", redact(" ".join(str(original).split())) or type(exc).__name__
        raise UsageError(f"--input {redact(source)}: cannot read it as {what} ({why}); "
                         "give a parquet or CSV path, glob or URL") from None
    return frame


def swarm(workers: int | None, memory_limit: str | None) -> DaskProfile:
    """The cluster started for the job: one single-threaded worker process per core by default."""
    return DaskProfile(kind="dask", n_workers=workers or max(1, min(os.cpu_count() or 1, 8)),
                       threads_per_worker=1, memory_limit=memory_limit)


def run(job: Job, frame: dd.DataFrame, root: Path, client: Any, progress: Progress | None = None, *,
        owned: bool) -> Scored:
    """Score every partition on ``client``'s workers; write the scores in input order, atomically.

    ``owned``: the cluster was started for this job, so workers that are gone will not come back."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from distributed import KilledWorker, wait

    start = time.perf_counter()
    columns = list(job.model.features) + ([job.key] if job.key != ROW else [])
    parts = frame[columns].to_delayed()
    futures = client.compute([_scored(part, root, job) for part in parts])
    done = _Counter(len(futures), progress)
    for future in futures:
        future.add_done_callback(done.tick)
    tmp = job.output.with_name(f".{job.output.name}.conveyor-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    rows = 0
    try:
        writer: pq.ParquetWriter | None = None
        try:
            stall = _Stall(client, done, owned=owned)
            for i, future in enumerate(futures):
                try:
                    part: pd.DataFrame = stall.result(future, i)
                except ConveyorError:
                    raise
                except KilledWorker:
                    raise ModelError(f"scoring partition {i} of {len(futures)} killed its worker (memory "
                                     f"limit{stall.limits() or ' unknown'}) each time it was tried: "
                                     f"{stall.ADVICE}") from None
                except Exception as exc:  # noqa: BLE001 - the scorer's own error, raised on a worker
                    raise ModelError(f"scoring partition {i} of {len(futures)} failed: "
                                     f"{type(exc).__name__}: {redact(str(exc))}") from None
                if job.key == ROW:
                    part.insert(0, ROW, range(rows, rows + len(part)))
                table = pa.Table.from_pandas(part, preserve_index=False)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema, write_page_checksum=True)
                writer.write_table(table)
                rows += len(part)
        finally:
            if writer is not None:
                writer.close()
        if writer is None:  # no partition at all: an empty file with the columns
            pq.write_table(pa.table({job.key: pa.array([], pa.int64()), SCORE: pa.array([], pa.float64())}), tmp,
                           write_page_checksum=True)
        os.replace(tmp, job.output)
    finally:
        with suppress(Exception):
            client.cancel(futures)
        with suppress(Exception):
            wait(futures, timeout=5)
        tmp.unlink(missing_ok=True)
    return Scored(rows, len(futures), len(client.scheduler_info().get("workers", {})),
                  time.perf_counter() - start, job.output, job.model, job.key)


def _scored(part: Any, root: Path, job: Job) -> Any:
    from dask.delayed import delayed

    return delayed(score_partition, pure=False)(part, root, job.spec, job.model, job.key)


class _Stall:
    """Waits for a partition's scores, and fails rather than wait forever on workers that cannot score.

    A Dask worker pauses above 80 % of its memory limit and resumes when its process shrinks;
    when what it holds is not data it could spill (the libraries' own memory, a model), it may
    never shrink. A worker over 95 % is restarted, and one that cannot even start within its
    limit is restarted again and again, or not at all. Either way the job would wait forever.
    Nothing scored and every worker paused and idle for ``STALL_S`` (on the swarm started for
    the job: no worker running anything, or none at all) ends the job with what to change; so
    does a partition that kills its worker each time it is tried.
    On a cluster of a profile, workers may be queued or scaling up: only paused ones count."""

    STALL_S = 15.0
    QUIET_S = 5.0  # nothing scored for this long before the workers are asked
    POLL_S = 1.0
    ADVICE = ("give the workers more memory (--memory-limit, or the profile's) or the partitions less "
              "(--partition-size)")

    def __init__(self, client: Any, done: _Counter, *, owned: bool) -> None:
        self.client, self.done, self.owned = client, done, owned
        self._seen, self._since = done.done, time.monotonic()
        self._stuck_since: float | None = None
        self._limits = ""
        self.limits()  # while the workers are there to say

    def result(self, future: Any, index: int) -> Any:
        # Waits on the futures' done callbacks, then asks once, without a timeout: distributed's
        # `result(timeout=)` runs under `asyncio.timeout`, whose expiry racing the gather has once
        # leaked a bare CancelledError past `distributed.utils.sync` (an UnboundLocalError).
        while not self.done.wait(future, self.POLL_S):
            self._check(index)
        return future.result()

    def _check(self, index: int) -> None:
        now = time.monotonic()
        if self.done.done != self._seen:
            self._seen, self._since, self._stuck_since = self.done.done, now, None
            return
        if now - self._since < self.QUIET_S:
            return
        workers = self.client.scheduler_info().get("workers", {})
        why = self._why(list(workers.values()))
        if why is None:
            self._stuck_since = None
            return
        if self._stuck_since is None:
            self._stuck_since = now
        if now - self._stuck_since >= self.STALL_S:
            raise ModelError(f"scoring partition {index} of {self.done.total}: {why} for {self.STALL_S:.0f}s with "
                             f"nothing scored (memory limit{self.limits() or ' unknown'}): {self.ADVICE}")

    def _why(self, workers: list[Mapping[str, Any]]) -> str | None:
        """What keeps every worker from scoring, or None while one may."""
        if not workers:
            return "no worker has been up (each died starting within its memory limit)" if self.owned else None
        executing = any(_counts(w).get("executing", 0) for w in workers)
        if not executing and all(w.get("status") == "paused" for w in workers):
            return "every worker has been paused at its memory limit"
        if not executing and self.owned:
            return "no worker has been running (each died or was restarted at its memory limit)"
        return None

    def limits(self) -> str:
        """`` 400 MiB each``, as the scheduler says (or last said), or nothing when it cannot say."""
        try:
            workers = self.client.scheduler_info().get("workers", {})
            limits = {int(w.get("memory_limit") or 0) for w in workers.values()}
        except Exception:  # noqa: BLE001 - only decorates the message of an error
            return self._limits
        if len(limits) == 1 and (limit := limits.pop()):
            self._limits = f" {limit / 2**20:,.0f} MiB each"
        return self._limits


def _counts(worker: Mapping[str, Any]) -> Mapping[str, int]:
    counts: Mapping[str, int] = (worker.get("metrics") or {}).get("task_counts") or {}
    return counts


class _Counter:
    """The partitions scored so far (each future's done callback ticks it), and a wait on one."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress
        self._changed = threading.Condition()
        if progress is not None:
            progress(0, total)

    def tick(self, _future: Any) -> None:
        with self._changed:
            self.done += 1
            done = self.done
            self._changed.notify_all()
        if self.progress is not None:
            self.progress(done, self.total)

    def wait(self, future: Any, timeout: float) -> bool:
        """Whether ``future`` is done, waiting up to ``timeout`` seconds for it."""
        with self._changed:
            return bool(self._changed.wait_for(future.done, timeout))


# --------------------------------------------------------------------------- on a worker

_LOADED: dict[tuple[str, str], Scorer] = {}  # (root, version) -> the model, loaded once per process
_LOADING = threading.Lock()


def score_partition(part: pd.DataFrame, root: Path, spec: ModelSpec, model: ModelVersion, key: str) -> pd.DataFrame:
    """One partition's scores (the Dask task): ``key`` column (when it is the input's) and ``score``."""
    import numpy as np
    import pandas as pd

    scorer = cached_scorer(root, spec, model)
    scores = scorer.score(part) if len(part) else np.empty(0)
    frame = pd.DataFrame({SCORE: pd.Series(scores, dtype="float64", index=part.index)})
    if key != ROW:
        frame.insert(0, key, part[key])
    return frame.reset_index(drop=True)


def cached_scorer(root: Path, spec: ModelSpec, model: ModelVersion) -> Scorer:
    with _LOADING:
        found = _LOADED.get((str(root), model.version))
        if found is None:
            found = _LOADED[(str(root), model.version)] = load_scorer(root, spec, model)
        return found


def describe(scored: Scored) -> str:
    rate = scored.rows / scored.wall_s if scored.wall_s > 0 else 0.0
    return (f"scored {scored.rows:,} rows in {_n(scored.partitions, 'partition')} on {_n(scored.workers, 'worker')} "
            f"in {scored.wall_s:.1f}s ({rate:,.{0 if rate >= 10 else 1}f} rows/s) with model {scored.model.version} "
            f"({scored.model.source}): {scored.output}")


def _n(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def options_of(project: Project, profile: str | None, workers: int | None,
               memory_limit: str | None) -> tuple[Mapping[str, Any], str]:
    """The profiles to start from and the one to score on: a profile of the spec, or the swarm."""
    if profile is None:
        return {SWARM: swarm(workers, memory_limit)}, SWARM
    profiles = project.pipeline.profiles
    if profile not in profiles:
        from conveyor.errors import did_you_mean

        raise UsageError(f"--profile {profile}: unknown profile{did_you_mean(profile, profiles)} "
                         f"(profiles: {', '.join(profiles) or 'none'})")
    if workers is not None or memory_limit is not None:
        raise UsageError("--workers and --memory-limit size the swarm started for the job; a --profile "
                         "says its own size")
    if profiles[profile].kind == "threads":
        raise UsageError(f"--profile {profile} is a thread pool: predict scores on a Dask profile "
                         "(dask, dask-cuda, slurm)")
    return profiles, profile
