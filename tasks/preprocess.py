"""Preprocess: clean, split, impute and standardise the raw parts, on Dask or in process.

Three passes over the raw parts, each one task per part that returns a small result, so
nothing is held between passes and the data may be larger than the cluster's memory:

1. the split keys' histogram per class (summed on the workers, a tree of partial sums);
2. the keys in the bins that hold a cut point, and the train statistics of the rows past
   them: from both, the exact per-class cut points and the train statistics;
3. each part split, standardised and written as three parquet parts, one per split.

Statistics are fitted on the train split only, so nothing of valid/test leaks into the models.
What works on one part is plain pandas and numpy (:mod:`tasks.split`, :mod:`tasks.moments`,
:func:`boundary`, :func:`standardised_table`, :func:`write_split_parts`): the same steps on one
pandas frame are the single-process version.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tasks import inputs
from tasks.files import write_json
from tasks.moments import DDOF, ColumnStats, Moments
from tasks.split import (
    SPLITS,
    Cuts,
    Fractions,
    Thresholds,
    class_counts,
    cut_points,
    key_bins,
    key_histogram,
    past_end,
    split_codes,
    split_keys,
    thresholds,
)

if TYPE_CHECKING:
    import logging

    import dask.dataframe as dd
    import numpy as np
    import numpy.typing as npt
    import pandas as pd
    import pyarrow as pa
    from dask.delayed import Delayed
    from distributed import Client

    from conveyor import StageContext

SPLIT_COLUMN = "split"
SCALED_LIMIT = 1e6  # standard deviations a scaled value is clipped to; the train split lies within a few dozen
AT_ONCE_BELOW = 128 * 2**20  # parquet bytes a stage without a cluster reads at once, as one partition
HOLD_SHARE = 0.25  # a cluster holds the cleaned rows in memory when they take at most this share of its memory
_FAN_IN = 8  # partial results combined per task when summing them on the workers

T = TypeVar("T")


@dataclass(frozen=True)
class Boundary:
    """What the second pass finds: the rows in a bin holding a cut point (their labels, keys,
    bins and features) and the moments of the rows past their class's valid|train bin."""

    labels: npt.NDArray[Any]
    keys: npt.NDArray[np.float64]
    bins: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]
    past: Moments

    def __add__(self, other: Boundary) -> Boundary:
        import numpy as np

        return Boundary(labels=np.concatenate([self.labels, other.labels]),
                        keys=np.concatenate([self.keys, other.keys]), bins=np.concatenate([self.bins, other.bins]),
                        values=np.concatenate([self.values, other.values]), past=self.past + other.past)


def prepare(ctx: StageContext) -> None:
    """Read the raw parts, split them, fit stats on train, write ``<out>/{split}/`` and ``<out>/stats.json``."""
    params: Mapping[str, Any] = ctx.section("preprocess")
    label, seed = str(params["label"]), int(ctx.params["seed"])
    fractions = Fractions(valid=float(params["valid_fraction"]), test=float(params["test_fraction"]))
    raw = ctx.dep()
    source = inputs.declared(ctx, raw)
    ctx.progress.start(3, unit="steps", description="preprocessing")
    with inputs.naming_bad_parts(raw, source):
        # no cluster (a stage placed in process): small data as one partition, computed in this thread
        raw_frame = inputs.read_parts(raw, source, at_once_below=AT_ONCE_BELOW if ctx.client is None else 0)
        scheduler = "sync" if ctx.client is None and raw_frame.npartitions == 1 else None
        if scheduler is not None:
            ctx.log.info("%s read at once: one partition, computed in this process", source)
        frame = clean(raw_frame, label, source=source)
        if ctx.client is not None:
            frame = _held_if_it_fits(ctx.client, frame, raw, source, ctx.log)
        features = [column for column in frame.columns if column != label]
        parts = frame.to_delayed()
        cuts = locate_cuts(parts, label=label, seed=seed, fractions=fractions, source=source, scheduler=scheduler)
        ctx.progress.advance(1)
        limits, stats = fit(parts, cuts, label=label, seed=seed, features=features, scheduler=scheduler)
        ctx.progress.advance(1)
        out = ctx.out()
        class_counts = write_splits(parts, out, limits, stats, label=label, seed=seed, scheduler=scheduler)
    summary = _summary(label, features, seed, fractions, stats, class_counts)
    write_json(out / "stats.json", summary)
    ctx.progress.advance(1)
    ctx.log.info("split rows: %s", summary["rows"])


def _held_if_it_fits(client: Client, frame: dd.DataFrame, raw: Path, source: str, log: logging.Logger) -> dd.DataFrame:
    """The cleaned rows held in the workers' memory when they take at most ``HOLD_SHARE`` of it
    (their uncompressed size, from the parts' footers): the three passes then read the parts
    once, not once each. Larger data is read once per pass and never held."""
    from dask.utils import format_bytes

    limits = [int(worker.get("memory_limit") or 0) for worker in client.scheduler_info()["workers"].values()]
    if not limits or min(limits) <= 0:
        log.info("%s read once per pass: the workers have no memory limit to size it against", source)
        return frame
    size = inputs.uncompressed_bytes(raw)
    if size > HOLD_SHARE * sum(limits):
        log.info("%s (%s uncompressed) read once per pass: more than %d%% of the workers' memory (%s)",
                 source, format_bytes(size), round(HOLD_SHARE * 100), format_bytes(sum(limits)))
        return frame
    log.info("%s (%s uncompressed) held in the workers' memory (%s): read once, not once per pass",
             source, format_bytes(size), format_bytes(sum(limits)))
    held: dd.DataFrame = client.persist(frame)
    return held


def clean(frame: dd.DataFrame, label: str, *, source: str = "the data") -> dd.DataFrame:
    """Drop rows without a label; a float label (CSV ingest) becomes int64.

    The label must be a column and every other column numeric (``source`` names the data
    in the errors): both are checked on the frame's metadata, before any row is read.
    Exact duplicate rows are kept: dropping them needs a shuffle that reorders rows, and
    duplicates cannot leak across splits anyway (a row's split is a hash of its values).
    """
    import pandas as pd

    inputs.check_columns(frame, label, source)
    frame = frame.dropna(subset=[label])
    if pd.api.types.is_float_dtype(frame[label].dtype):
        frame = frame.astype({label: "int64"})
    return frame


def locate_cuts(parts: Sequence[Delayed], *, label: str, seed: int, fractions: Fractions, source: str = "the data",
                scheduler: str | None = None) -> Cuts:
    """Pass 1: per class, the bins and ranks within them of the two cut points (:mod:`tasks.split`).

    The histogram also counts the classes: fewer than two is an error naming ``source``.
    ``scheduler``: dask's (None: the current client's, else dask's default).
    """
    from dask.delayed import delayed

    histogram = _summed([delayed(_histogram_part)(part, label, seed) for part in parts], _add_histograms, scheduler)
    inputs.check_classes(list(histogram), label, source)
    return cut_points(histogram, fractions)


def fit(parts: Sequence[Delayed], cuts: Cuts, *, label: str, seed: int, features: list[str],
        scheduler: str | None = None) -> tuple[Thresholds, ColumnStats]:
    """Pass 2: the exact per-class thresholds, and the statistics of the train split.

    The train rows are those past a class's valid|train bin (their moments, summed) and
    those in that bin from the threshold on (a few rows, read back whole).
    """
    from dask.delayed import delayed

    found = _summed([delayed(_boundary_part)(part, label, seed, cuts, features) for part in parts],
                    _add_boundaries, scheduler)
    limits = thresholds(cuts, found.labels, found.keys, found.bins)
    return limits, train_stats(found, cuts, limits, features)


def write_splits(parts: Sequence[Delayed], out: Path, limits: Thresholds, stats: ColumnStats, *, label: str,
                 seed: int, scheduler: str | None = None) -> pd.Series:
    """Pass 3: each part split, standardised and written as ``out/{split}/part-NNNNN.parquet``
    (:func:`part_name`, in partition order); the rows written per (split, class)."""
    from dask.delayed import delayed

    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    features = list(stats.mean.index)
    return _summed([delayed(_write_part)(part, index, str(out), label, seed, limits, features, stats.mean, stats.std)
                    for index, part in enumerate(parts)], _add_counts, scheduler)


def split_rows(frame: dd.DataFrame, *, label: str, seed: int, fractions: Fractions, source: str = "the data",
               scheduler: str | None = None) -> dd.DataFrame:
    """``frame`` with a ``split`` column (``train``, ``valid``, ``test``): passes 1 and 2, lazily tagged."""
    parts = frame.to_delayed()
    cuts = locate_cuts(parts, label=label, seed=seed, fractions=fractions, source=source, scheduler=scheduler)
    features = [column for column in frame.columns if column != label]
    limits, _ = fit(parts, cuts, label=label, seed=seed, features=features, scheduler=scheduler)
    tagged: dd.DataFrame = frame.map_partitions(_tag_split, label, seed, limits)
    return tagged


def column_stats(frame: dd.DataFrame) -> ColumnStats:
    """Mean, std (``DDOF``) and non-missing count of every column, across partitions."""
    from dask.delayed import delayed

    moments = _summed([delayed(_moments_part)(part) for part in frame.to_delayed()], _add_moments, None)
    return moments.stats([str(column) for column in frame.columns])


# --- one part: plain pandas and numpy ---------------------------------------------------


def boundary(part: pd.DataFrame, label: str, keys: npt.NDArray[np.float64], cuts: Cuts,
             features: list[str]) -> Boundary:
    """The rows of ``part`` in a bin holding one of their class's cut points, and the moments
    of its rows in bins past their class's valid|train cut (train, whatever the thresholds)."""
    import numpy as np

    bins = key_bins(keys)
    labels = part[label]
    test_bin = labels.map({cls: test[0] for cls, (test, _) in cuts.items()}).to_numpy(np.int64)
    train_bin = labels.map({cls: past_end(valid[0]) for cls, (_, valid) in cuts.items()}).to_numpy(np.int64)
    at_cut = (bins == test_bin) | (bins == train_bin)
    values = part[features].to_numpy()  # in the columns' dtype: rows are picked before any float64 copy
    return Boundary(labels=labels.to_numpy()[at_cut], keys=keys[at_cut], bins=bins[at_cut],
                    values=values[at_cut].astype(np.float64), past=Moments.of(values[bins > train_bin]))


def train_stats(found: Boundary, cuts: Cuts, limits: Thresholds, features: list[str]) -> ColumnStats:
    """The train split's statistics: the rows past each class's valid|train bin, plus those
    in that bin at or above the class's threshold."""
    import numpy as np

    train_bin = np.array([past_end(cuts[cls][1][0]) for cls in found.labels.tolist()], dtype=np.int64)
    threshold = np.array([limits[cls][1] for cls in found.labels.tolist()], dtype=np.float64)
    in_train = (found.bins == train_bin) & (found.keys >= threshold)
    return (found.past + Moments.of(found.values[in_train])).stats(features)


def standardise_rows(rows: pd.DataFrame, features: list[str], mean: pd.Series, std: pd.Series) -> pd.DataFrame:
    """The feature columns of ``rows``, missing values imputed with the train mean, centred and
    scaled by the train std: what the models were trained on (predict applies it to raw rows).
    Values beyond :data:`SCALED_LIMIT` standard deviations are clipped to it: float32 models
    (xgboost, torch) would otherwise see infinities where an absurd raw value overflows."""
    import pandas as pd

    return pd.DataFrame(_standardised_values(rows, features, mean, std), columns=features, index=rows.index)


def standardised_table(part: pd.DataFrame, features: list[str], mean: pd.Series, std: pd.Series) -> pa.Table:
    """``part`` as an Arrow table, its columns in order, the features standardised (:func:`standardise_rows`)."""
    import pyarrow as pa

    values = _standardised_values(part, features, mean, std)
    at = {column: j for j, column in enumerate(features)}
    return pa.Table.from_arrays(
        [pa.array(values[:, at[column]]) if column in at else pa.Array.from_pandas(part[column])
         for column in part.columns],
        names=[str(column) for column in part.columns])


def _standardised_values(rows: pd.DataFrame, features: list[str], mean: pd.Series,
                         std: pd.Series) -> npt.NDArray[np.float64]:
    """The standardised features as one float64 array, a column's values contiguous where
    pandas holds them so (an Arrow column of it is then no copy)."""
    import numpy as np

    centre, scale = mean[features].to_numpy(np.float64), std[features].to_numpy(np.float64)
    values = rows[features].to_numpy(np.float64, copy=True)
    np.copyto(values, np.broadcast_to(centre, values.shape), where=np.isnan(values))
    values -= centre
    values /= scale
    np.clip(values, -SCALED_LIMIT, SCALED_LIMIT, out=values)
    return values


def write_split_parts(table: pa.Table, codes: npt.NDArray[np.int8], out: Path, name: str, label: str) -> None:
    """The rows of ``table`` as ``out/{split}/name``, one parquet file per split (empty ones too).

    Page checksums, so that a damaged page is an error when read, not wrong values; a
    dictionary for the label only (standardised floats are all distinct: a dictionary would
    be built and thrown away, the slowest part of writing them).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    for code, split in enumerate(SPLITS):
        pq.write_table(table.filter(pa.array(codes == code)), out / split / name, use_dictionary=[label],
                       write_page_checksum=True)


def part_name(index: int) -> str:
    """Zero-padded part names, so that lexicographic order (pyarrow's) is partition order."""
    return f"part-{index:05d}.parquet"


# --- the tasks of the three passes, and how their results add up ----------------------------


def _histogram_part(part: pd.DataFrame, label: str, seed: int) -> dict[Any, npt.NDArray[np.int64]]:
    return key_histogram(part[label].to_numpy(), split_keys(part, seed))


def _boundary_part(part: pd.DataFrame, label: str, seed: int, cuts: Cuts, features: list[str]) -> Boundary:
    return boundary(part, label, split_keys(part, seed), cuts, features)


def _moments_part(part: pd.DataFrame) -> Moments:
    import numpy as np

    return Moments.of(part.to_numpy(np.float64))


def _write_part(part: pd.DataFrame, index: int, out: str, label: str, seed: int, limits: Thresholds,
               features: list[str], mean: pd.Series, std: pd.Series) -> pd.Series:
    """Pass 3 on one part: split, standardise, write; the rows written per (split, class)."""
    codes = split_codes(part[label], split_keys(part, seed), limits)
    write_split_parts(standardised_table(part, features, mean, std), codes, Path(out), part_name(index), label)
    return class_counts(codes, part[label])


def _add_histograms(*many: dict[Any, npt.NDArray[np.int64]]) -> dict[Any, npt.NDArray[np.int64]]:
    total: dict[Any, npt.NDArray[np.int64]] = {}
    for histogram in many:
        for cls, counts in histogram.items():
            total[cls] = total[cls] + counts if cls in total else counts
    return total


def _add_boundaries(*many: Boundary) -> Boundary:
    return functools.reduce(operator.add, many)


def _add_moments(*many: Moments) -> Moments:
    return functools.reduce(operator.add, many)


def _add_counts(*many: pd.Series) -> pd.Series:
    import pandas as pd

    total: pd.Series = pd.concat(many).groupby(level=[0, 1]).sum()
    return total


def _summed(results: Sequence[Delayed], add: Callable[..., T], scheduler: str | None) -> T:
    """The per-part ``results`` added up on the workers, ``_FAN_IN`` at a time; one compute."""
    from dask.base import compute
    from dask.delayed import delayed

    level = list(results)
    while len(level) > 1:
        level = [delayed(add)(*level[i:i + _FAN_IN]) for i in range(0, len(level), _FAN_IN)]
    (total,) = compute(level[0], scheduler=scheduler)
    return total  # type: ignore[no-any-return]


def _tag_split(part: pd.DataFrame, label: str, seed: int, limits: Thresholds) -> pd.DataFrame:
    """``part`` with the ``split`` column, from the per-class thresholds."""
    import numpy as np

    codes = split_codes(part[label], split_keys(part, seed), limits)
    return part.assign(**{SPLIT_COLUMN: np.asarray(SPLITS, dtype=object)[codes]})


def _summary(
    label: str,
    features: list[str],
    seed: int,
    fractions: Fractions,
    stats: ColumnStats,
    class_counts: pd.Series,
) -> dict[str, Any]:
    """The content of stats.json: what training needs and what a reader checks."""
    table = class_counts.unstack(fill_value=0).reindex(list(SPLITS), fill_value=0).to_dict(orient="index")
    per_class = {split: {str(cls): int(n) for cls, n in table[split].items()} for split in SPLITS}
    rows = {split: sum(per_class[split].values()) for split in SPLITS}
    return {
        "label": label,
        "features": features,
        "seed": seed,
        "fractions": {"valid": fractions.valid, "test": fractions.test},
        "ddof": DDOF,
        "mean": {f: float(stats.mean[f]) for f in features},
        "std": {f: float(stats.std[f]) for f in features},
        "rows": rows,
        "class_counts": per_class,
    }


def load_stats(processed: Path) -> dict[str, Any]:
    """The stats.json that :func:`prepare` wrote next to the splits."""
    stats: dict[str, Any] = json.loads((processed / "stats.json").read_text())
    return stats
