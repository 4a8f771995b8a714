"""predict-batch: `conveyor predict` on a swarm of 2 workers vs one process scoring the same file.

Both score the reference project's stacked model (trained once here by ``conveyor run``) with the project's
own ``tasks.predict`` functions, on one parquet file of its 569 raw rows sampled with replacement and
jittered (x 1 + 1 % Gaussian noise), in row groups of 100,000. Candidate: ``conveyor predict --workers 2``
(a LocalCluster of 2 single-threaded workers started for the job, the file read in partitions). Baseline:
``plain_predict.py``, one process scoring the whole file in one call (torch and XGBoost with their default
threads). Each command timed whole by hyperfine, alternating, its process tree's peak RSS sampled by psutil.
Checked: every output holds every row in input order, probabilities, the first run's scores (relative 1e-6:
float32 matmuls round differently for another batch size); conveyor says it scored N rows on 2 workers.
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


def run(config: Config, log: Callable[[str], None]) -> Result:
    rows = 200_000 if config.quick else 2_000_000
    repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-predict-"))
    expected: list[np.ndarray[Any, np.dtype[np.float64]]] = []
    reported: list[tuple[int, float]] = []  # conveyor's own line: partitions, seconds
    try:
        root, env = trained_reference(scratch, log, NAME)
        source = scratch / "rows.parquet"
        raw = pq.read_table(root / "data/raw").to_pandas().drop(columns=["target"])
        rng = np.random.default_rng(16)
        with pq.ParquetWriter(source, pa.Schema.from_pandas(raw, preserve_index=False)) as writer:
            for start in range(0, rows, GROUP):
                picked = raw.iloc[rng.integers(0, len(raw), min(GROUP, rows - start))].reset_index(drop=True)
                writer.write_table(pa.Table.from_pandas(picked * (1 + 0.01 * rng.standard_normal(picked.shape)),
                                                        preserve_index=False))
        log(f"{NAME}: {rows:,} rows, {source.stat().st_size / 2**20:.0f} MiB of parquet")

        def side(what: str, args: list[str]) -> Callable[[int], tuple[float, float]]:
            def once(i: int) -> tuple[float, float]:
                output = scratch / f"{i}.parquet"
                done = timed_cli([str(output) if a == "OUT" else a for a in args], root, env, memory=True)
                if what == "conveyor predict":
                    said = SCORED.search(done.stdout)
                    check(said is not None and int(said[1].replace(",", "")) == rows and said[3] == "2",
                          f"conveyor predict did not say it scored {rows:,} rows on 2 workers: {done.stdout[-500:]}")
                    assert said is not None
                    reported.append((int(said[2]), float(said[4])))
                frame = pd.read_parquet(output)
                output.unlink()
                check(list(frame.columns) == ["row", "score"] and len(frame) == rows
                      and bool((frame["row"].to_numpy() == np.arange(rows)).all()),
                      f"{what} wrote {list(frame.columns)} x {len(frame)}, not row, score of {rows:,} rows in order")
                scores = frame["score"].to_numpy(dtype="float64")
                check(bool(np.isfinite(scores).all() & ((scores >= 0) & (scores <= 1)).all()),
                      f"{what} wrote scores that are not probabilities")
                if not expected:
                    expected.append(scores)
                worst = float(np.max(np.abs(scores - expected[0]) / np.maximum(np.abs(expected[0]), 1e-12)))
                check(worst <= RTOL, f"{what}'s scores differ from the first run's by up to {worst:.2e} (relative)")
                return done.seconds, done.peak_mib
            return once

        log(f"{NAME}: {repeats} interleaved repetitions")
        base, cand = interleaved(repeats, side("the plain script", [sys.executable, str(PLAIN), str(root), str(source),
                                                                    "OUT"]),
                                 side("conveyor predict", [conveyor_command(), "predict", "-i", str(source), "-o",
                                                           "OUT", "--workers", "2"]), log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = Metric("wall of the command (s)", [w for w, _ in base], [w for w, _ in cand])
    inside = median([s for _, s in reported])
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`python plain_predict.py`: one process, pandas, the project's load/score on the whole file",
        candidate="`conveyor predict --workers 2`: a 2-worker LocalCluster started for the job, in partitions",
        repeats=repeats, metrics=[wall, Metric("rows scored per second (whole command)", [rows / w for w, _ in base],
                                               [rows / w for w, _ in cand], ratio="candidate/baseline", digits=0),
                                  Metric("peak RSS of the process tree (MiB)", [m for _, m in base],
                                         [m for _, m in cand], digits=0)],
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
        notes=[f"conveyor read the file in {' or '.join(sorted({str(p) for p, _ in reported}))} partition(s); its "
               f"own line says the scoring (the cluster up, from the first partition submitted to the file renamed "
               f"into place) took a median {inside:.2f} s ({rows / inside:,.0f} rows/s); the rest of its wall is the "
               "interpreter, imports, checking the input, starting and stopping the cluster"],
    )
