"""The peer of the preprocess stage a user would write: its steps in one pandas process, no dask, no conveyor.

``plain_preprocess.py RAW OUT [--label L] [--valid F] [--test F] [--seed S]``: ``OUT/<split>/part-00000.parquet``,
``OUT/stats.json``; one JSON line: ``seconds``, ``imports``, ``rows``, ``forbidden``.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

STARTED = time.perf_counter()

import numpy as np  # noqa: E402 - after STARTED: the imports are timed apart from the work
import numpy.typing as npt  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet  # noqa: E402 - what pd.read_parquet and the writes use

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tasks/ of this repository, as a script

from tasks import inputs  # noqa: E402
from tasks import preprocess as prep  # noqa: E402
from tasks import split as splitting  # noqa: E402
from tasks.files import write_json  # noqa: E402
from tasks.moments import ColumnStats, Moments  # noqa: E402

IMPORTED = time.perf_counter()
FORBIDDEN = ("dask", "distributed", "conveyor", "prefect")


class Split(NamedTuple):  # rows standardised, split codes, train statistics, rows per split/class
    rows: pa.Table
    codes: npt.NDArray[np.int8]
    stats: ColumnStats
    class_counts: pd.Series


def split_frame(frame: pd.DataFrame, *, label: str, seed: int, fractions: splitting.Fractions, source: str) -> Split:
    """The stage's steps on one cleaned frame, each once: exact stratified split, train statistics, standardising."""
    features = [column for column in frame.columns if column != label]
    keys, labels = splitting.split_keys(frame, seed), frame[label].to_numpy()
    histogram = splitting.key_histogram(labels, keys)
    inputs.check_classes(list(histogram), label, source)
    limits = splitting.thresholds(splitting.cut_points(histogram, fractions), labels, keys, splitting.key_bins(keys))
    codes = splitting.split_codes(frame[label], keys, limits)
    stats = Moments.of(frame.loc[codes == splitting.TRAIN, features].to_numpy(np.float64)).stats(features)
    return Split(prep.standardised_table(frame, features, stats.mean, stats.std), codes, stats,
                 splitting.class_counts(codes, frame[label]))


def preprocess(raw: Path, out: Path, *, label: str = "target", valid: float = 0.15, test: float = 0.2,
               seed: int = 42) -> dict[str, Any]:
    """The preprocess stage's steps on one pandas frame; the stats.json it wrote."""
    fractions = splitting.Fractions(valid=valid, test=test)
    frame = cast(pd.DataFrame, prep.clean(cast(Any, pd.read_parquet(raw)), label, source=str(raw)))
    split = split_frame(frame, label=label, seed=seed, fractions=fractions, source=str(raw))
    for name in splitting.SPLITS:
        (out / name).mkdir(parents=True, exist_ok=True)
    prep.write_split_parts(split.rows, split.codes, out, "part-00000.parquet", label)
    summary = prep._summary(label, [c for c in frame.columns if c != label], seed, fractions, split.stats,
                            split.class_counts)
    write_json(out / "stats.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plain_preprocess.py", description=__doc__.splitlines()[0])
    for flag, default in (("raw", Path()), ("out", Path()), ("--label", "target"), ("--valid", 0.15),
                          ("--test", 0.2), ("--seed", 42)):
        parser.add_argument(flag, type=type(default), default=default)
    a, began = parser.parse_args(argv), time.perf_counter()
    summary = preprocess(a.raw, a.out, label=a.label, valid=a.valid, test=a.test, seed=a.seed)
    print(json.dumps({"seconds": time.perf_counter() - began, "imports": IMPORTED - STARTED, "rows": summary["rows"],
                      "forbidden": sorted(m for m in FORBIDDEN if m in sys.modules)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
