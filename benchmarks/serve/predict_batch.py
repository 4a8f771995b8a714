"""predict-batch: `conveyor predict` on a swarm of 2 workers vs one process scoring the same file.

The reference model (trained here) scores a parquet file of its raw rows, resampled and jittered: ``conveyor predict
--workers 2`` against ``plain.py predict`` (one call), alternating, each with its tree's peak RSS. Checked: every output
holds every row in order, probabilities, the first run's scores (relative 1e-6); conveyor scored N rows on 2 workers."""

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.commands import Timed
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, scratch
from benchmarks.overhead.reference import trained_reference
from benchmarks.projects import timed_cli

NAME = "predict-batch"
DESCRIPTION = "conveyor predict on a swarm of 2 workers vs one process (pandas) scoring the same file"
PLAIN = Path(__file__).resolve().parent / "plain.py"
GROUP, RTOL = 100_000, 1e-6  # rows per parquet row group; float32 matmuls round differently for another batch size
SCORED = re.compile(r"scored ([\d,]+) rows in (\d+) partitions? on (\d+) workers? in ([\d.]+)s")


def run(config: Config, log: Callable[[str], None]) -> Result:
    rows, repeats = 200_000 if config.quick else 2_000_000, config.reps(full=3, quick=1)
    expected: dict[str, np.ndarray[Any, np.dtype[np.float64]]] = {}
    inside: list[float] = []  # conveyor's own seconds of scoring
    with scratch("predict") as folder:
        root, env = trained_reference(folder, log, NAME)
        source, rng = folder / "rows.parquet", np.random.default_rng(16)
        raw = pq.read_table(root / "data/raw").to_pandas().drop(columns=["target"])
        with pq.ParquetWriter(source, pa.Schema.from_pandas(raw, preserve_index=False)) as writer:
            for start in range(0, rows, GROUP):
                picked = raw.iloc[rng.integers(0, len(raw), min(GROUP, rows - start))].reset_index(drop=True)
                writer.write_table(pa.Table.from_pandas(picked * (1 + 0.01 * rng.standard_normal(picked.shape)),
                                                        preserve_index=False))
        mib = source.stat().st_size / 2**20

        def once(what: str, i: int, *args: str) -> Timed:
            output = folder / f"{i}.parquet"
            done = timed_cli([str(output) if a == "OUT" else a for a in args], root, env, memory=True)
            if said := SCORED.search(done.stdout):
                inside.append(float(said[4]))
            check(what != "conveyor predict" or bool(said and said[1].replace(",", "") == str(rows) and said[3] == "2"),
                  f"conveyor predict did not say it scored {rows:,} rows on 2 workers: {done.stdout[-500:]}")
            frame = pd.read_parquet(output)
            output.unlink()
            scores = frame["score"].to_numpy(dtype="float64") if "score" in frame else np.zeros(0)
            first = expected.setdefault("first", scores)
            worst = float(np.max(np.abs(scores - first) / np.maximum(np.abs(first), 1e-12), initial=0))
            check(list(frame.columns) == ["row", "score"] and len(frame) == rows and bool((frame["row"].to_numpy() ==
                  np.arange(rows)).all() & np.isfinite(scores).all() & ((scores >= 0) & (scores <= 1)).all())
                  and worst <= RTOL, f"{what} wrote {list(frame.columns)} x {len(frame)}, not row and a probability "
                  f"for {rows:,} rows in order, or scores {worst:.2e} (relative) from the first run's")
            return done
        base, cand = interleaved(repeats, lambda i: once("the plain script", i, sys.executable, str(PLAIN), "predict",
                                                         str(root), str(source), "OUT"),
                                 lambda i: once("conveyor predict", i, "conveyor", "predict", "-i", str(source),
                                                "-o", "OUT", "--workers", "2"), log)
    return Result(
        NAME, DESCRIPTION, "`python plain.py predict`: one process, pandas, the project's load/score on the whole file",
        "`conveyor predict --workers 2`: a 2-worker LocalCluster started for the job, in partitions", repeats, [
            Metric("wall of the command (s)", [t.seconds for t in base], [t.seconds for t in cand]),
            Metric("rows scored per second (whole command)", [rows / t.seconds for t in base],
                   [rows / t.seconds for t in cand], ratio="candidate/baseline", digits=0),
            Metric("peak RSS of the process tree (MiB)", [t.peak_mib for t in base], [t.peak_mib for t in cand],
                   digits=0)],
        setup={"input": f"{rows:,} rows, {mib:.0f} MiB of parquet"},
        notes=[f"conveyor's own line says the scoring took a median {median(inside):.2f} s "
               f"({rows / median(inside):,.0f} rows/s)"])
