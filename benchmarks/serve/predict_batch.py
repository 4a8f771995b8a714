"""predict-batch: `conveyor predict` on a swarm of 2 workers vs one process scoring the same file.

The question: what does a user gain, or pay, scoring a large file with ``conveyor predict``
instead of the script they would write? Both score the reference project's model (the
stacked XGBoost + torch MLP + logistic regression of ``configs/pipeline.yaml``'s ``model:``
section, trained once here by ``conveyor run``) with the project's own ``tasks.predict``
functions, on the same parquet file of raw rows.

- candidate: ``conveyor predict -i rows.parquet -o scores.parquet --workers 2``: a
  LocalCluster of 2 single-threaded worker processes started for the job, the file read in
  partitions (``--partition-size`` default, 64 MiB), each worker loading the model once,
  the scores written in input order, the cluster closed.
- baseline: ``benchmarks/serve/plain_predict.py``: one process reads the whole file with pandas,
  loads the model with the spec's ``load``, scores every row in one call of its ``predict``,
  writes ``row`` and ``score``. Its libraries use the cores as they do by default (torch's
  intra-op threads, XGBoost's ``nthread``); Dask's workers run with one thread each.

The rows are the project's 569 raw rows, sampled with replacement and jittered (each value
times 1 + 1 % Gaussian noise), in row groups of 100,000 rows. Both sides are timed from the
command's start to its exit (interpreter, imports, the model's load and, for conveyor, the
cluster's start and stop included), alternating. Before any ratio: both exit 0; both
outputs hold every row in input order (``row`` 0..N-1) and the same scores (to 1e-6
relative: torch's float32 matmuls may round the last bits differently for another batch
size); conveyor says it scored N rows on 2 workers. Peak memory is the summed RSS of the
command's process tree (the command, Dask's nanny and worker processes), sampled from /proc
every 100 ms; shared pages are counted once per process.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.harness import Config, Metric, Result, check, interleaved, median
from benchmarks.overhead.reference import trained_reference
from benchmarks.projects import conveyor_command, timed_cli

NAME = "predict-batch"
DESCRIPTION = "conveyor predict on a swarm of 2 workers vs one process (pandas) scoring the same file"
PLAIN = Path(__file__).resolve().parent / "plain_predict.py"
GROUP = 100_000  # rows per parquet row group
RTOL = 1e-6
SCORED = re.compile(r"scored ([\d,]+) rows in (\d+) partitions? on (\d+) workers? in ([\d.]+)s")


def write_rows(root: Path, rows: int, path: Path) -> None:
    """``rows`` raw rows (no target) sampled from the project's data/raw, jittered, to ``path``."""
    raw = pq.read_table(root / "data/raw").to_pandas().drop(columns=["target"])
    rng = np.random.default_rng(16)
    with pq.ParquetWriter(path, pa.Schema.from_pandas(raw, preserve_index=False)) as writer:
        for start in range(0, rows, GROUP):
            n = min(GROUP, rows - start)
            picked = raw.iloc[rng.integers(0, len(raw), n)].reset_index(drop=True)
            jitter = 1 + 0.01 * rng.standard_normal(picked.shape)
            writer.write_table(pa.Table.from_pandas(picked * jitter, preserve_index=False))


def read_scores(path: Path, rows: int, what: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    frame = pd.read_parquet(path)
    check(list(frame.columns) == ["row", "score"], f"{what} wrote columns {list(frame.columns)}, not row, score")
    check(len(frame) == rows and bool((frame["row"].to_numpy() == np.arange(rows)).all()),
          f"{what} wrote {len(frame)} rows, not the {rows:,} of the input in order")
    scores: np.ndarray[Any, np.dtype[np.float64]] = frame["score"].to_numpy(dtype="float64")
    check(bool(np.isfinite(scores).all()) and bool(((scores >= 0) & (scores <= 1)).all()),
          f"{what} wrote scores that are not probabilities")
    return scores


def run(config: Config, log: Callable[[str], None]) -> Result:
    rows = 200_000 if config.quick else 2_000_000
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-predict-"))
    try:
        root, env = trained_reference(scratch, log, NAME)
        source = scratch / "rows.parquet"
        write_rows(root, rows, source)
        log(f"{NAME}: {rows:,} rows, {source.stat().st_size / 2**20:.0f} MiB of parquet")
        expected: list[np.ndarray[Any, np.dtype[np.float64]]] = []
        reported: list[tuple[int, int, float]] = []  # conveyor's own line: partitions, workers, seconds

        def plain(i: int) -> tuple[float, float]:
            output = scratch / f"plain-{i}.parquet"
            done = timed_cli([sys.executable, str(PLAIN), str(root), str(source), str(output)], root, env, memory=True)
            compare(read_scores(output, rows, "the plain script"), "the plain script")
            output.unlink()
            return done.seconds, done.peak_mib

        def conveyor(i: int) -> tuple[float, float]:
            output = scratch / f"conveyor-{i}.parquet"
            done = timed_cli([conveyor_command(), "predict", "-i", str(source), "-o", str(output), "--workers", "2"],
                             root, env, memory=True)
            stdout = done.stdout
            said = SCORED.search(stdout)
            check(said is not None and int(said.group(1).replace(",", "")) == rows and said.group(3) == "2",
                  f"conveyor predict did not say it scored {rows:,} rows on 2 workers: {stdout[-500:]}")
            assert said is not None
            reported.append((int(said.group(2)), int(said.group(3)), float(said.group(4))))
            compare(read_scores(output, rows, "conveyor predict"), "conveyor predict")
            output.unlink()
            return done.seconds, done.peak_mib

        def compare(scores: np.ndarray[Any, np.dtype[np.float64]], what: str) -> None:
            if not expected:
                expected.append(scores)
                return
            worst = float(np.max(np.abs(scores - expected[0]) / np.maximum(np.abs(expected[0]), 1e-12)))
            check(worst <= RTOL, f"{what}'s scores differ from the first run's by up to {worst:.2e} (relative)")

        log(f"{NAME}: {repeats} interleaved repetitions")
        base, cand = interleaved(repeats, plain, conveyor, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = Metric("wall of the command (s)", [w for w, _ in base], [w for w, _ in cand])
    rate = Metric("rows scored per second (whole command)", [rows / w for w, _ in base],
                  [rows / w for w, _ in cand], ratio="candidate/baseline", digits=0)
    memory = Metric("peak RSS of the process tree (MiB)", [m for _, m in base], [m for _, m in cand], digits=0)
    partitions = {p for p, _, _ in reported}
    inside = median([s for _, _, s in reported])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`python plain_predict.py`: one process, pandas, the project's load/score on the whole file",
        candidate="`conveyor predict --workers 2`: a 2-worker LocalCluster started for the job, in partitions",
        repeats=repeats, metrics=[wall, rate, memory],
        setup={"model": "the reference project's stacked model (XGBoost + torch MLP + logistic regression), "
                        "trained once by `conveyor run`",
               "input": f"{rows:,} raw rows (30 features), sampled from data/raw and jittered, parquet in row "
                        f"groups of {GROUP:,}",
               "swarm": "2 worker processes, 1 thread each, no memory limit given (Dask's default share)",
               "cores": str(os.cpu_count())},
        checks=["every run exited 0 and left no process of its group running",
                "both outputs hold every input row in order (row 0..N-1) and probabilities in [0, 1]",
                f"every run's scores equal the first run's to {RTOL:g} relative",
                f"conveyor said it scored {rows:,} rows on 2 workers"],
        notes=[f"conveyor read the file in {' or '.join(map(str, sorted(partitions)))} partition(s); its own line "
               f"says the scoring (the cluster up, from the first partition submitted to the file renamed into "
               f"place) took a median {inside:.2f} s ({rows / inside:,.0f} rows/s); the rest of its wall is the "
               "interpreter, imports, checking the input, starting and stopping the cluster",
               f"plain median {median(wall.baseline):.2f} s, conveyor median {median(wall.candidate):.2f} s"],
    )
