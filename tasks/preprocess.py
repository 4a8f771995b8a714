"""Preprocess: clean, split, impute and standardise the raw parts with dask.dataframe.

Everything stays a dask collection; only small aggregates (histograms of a split key,
column sums, counts) come back to this process. Statistics are fitted on the train
split only, so nothing of valid/test leaks into the models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks import inputs
from tasks.files import write_json

if TYPE_CHECKING:
    import dask.dataframe as dd
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

    from conveyor import StageContext

SPLITS = ("train", "valid", "test")
SPLIT_COLUMN = "split"
DDOF = 1  # sample standard deviation, as pandas' default
SCALED_LIMIT = 1e6  # standard deviations a scaled value is clipped to; the train split lies within a few dozen
AT_ONCE_BELOW = 128 * 2**20  # parquet bytes a stage without a cluster reads at once, as one partition
_BINS = 1 << 16  # histogram resolution of the split key when locating per-class cut points
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Fractions:
    """Share of each class's rows that goes to valid and to test; train gets the rest."""

    valid: float
    test: float

    def __post_init__(self) -> None:
        if min(self.valid, self.test) < 0 or self.valid + self.test >= 1:
            raise ValueError(
                f"preprocess: need valid_fraction, test_fraction >= 0 with a sum below 1, "
                f"got valid={self.valid}, test={self.test}"
            )


@dataclass(frozen=True)
class ColumnStats:
    """Train-split statistics of the feature columns (NaNs skipped, ``DDOF`` for std)."""

    mean: pd.Series
    std: pd.Series
    count: pd.Series


def prepare(ctx: StageContext) -> None:
    """Read the raw parts, split them, fit stats on train, write ``<out>/{split}/`` and ``<out>/stats.json``."""
    from dask.base import compute

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
        features = [column for column in frame.columns if column != label]
        tagged = split_rows(frame, label=label, seed=seed, fractions=fractions, source=source, scheduler=scheduler)
        ctx.progress.advance(1)
        stats, class_counts = compute(
            _column_stats_graph(_select(tagged, "train")[features]),
            tagged.groupby([SPLIT_COLUMN, label]).size(split_out=1),
            scheduler=scheduler,
        )
        column_stats = _finish_stats(*stats)
        ctx.progress.advance(1)
        out = ctx.out()
        writes = [
            standardise(_select(tagged, split), features, column_stats).to_parquet(
                str(out / split), write_index=False, compute=False, name_function=_part_name,
                write_page_checksum=True,  # a damaged page is an error when read, not wrong values
            )
            for split in SPLITS
        ]
        compute(*writes, scheduler=scheduler)
    summary = _summary(label, features, seed, fractions, column_stats, class_counts)
    write_json(out / "stats.json", summary)
    ctx.progress.advance(1)
    ctx.log.info("split rows: %s", summary["rows"])


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


def split_rows(
    frame: dd.DataFrame, *, label: str, seed: int, fractions: Fractions, source: str = "the data",
    scheduler: str | None = None,
) -> dd.DataFrame:
    """``frame`` with a ``split`` column: exactly stratified, seeded, partition-independent.

    Each row gets a uniform key from a hash of its values and the seed; within each class
    the rows with the smallest keys go to test, the next ones to valid, the rest to train,
    so every class contributes ``round(n_class * fraction)`` rows to each split (exact
    stratification, not Spark ``sampleBy``'s per-row coin flips; rows with identical
    values share a key and so a split). The per-class cut points come from a histogram
    of the keys plus the few keys in the bins that hold a cut point: two small aggregates.
    The histogram also counts the classes: fewer than two is an error naming ``source``.
    ``scheduler``: dask's for those two (None: the current client's, else dask's default).
    """
    keys = frame.map_partitions(_split_keys, label, seed)
    # split_out=1: a tree reduction to one small result, not a shuffle
    counts = keys.groupby([label, "bin"]).size(split_out=1).compute(scheduler=scheduler).sort_index()
    inputs.check_classes(counts, label, source)
    cuts = _cut_ranks(counts, fractions)
    boundary = keys[keys.map_partitions(_in_bins, label, sorted(_bins_of(cuts)))].compute(scheduler=scheduler)
    thresholds = _thresholds(cuts, boundary, label)
    tagged: dd.DataFrame = frame.map_partitions(_tag_split, label, seed, thresholds)
    return tagged


def standardise(frame: dd.DataFrame, features: list[str], stats: ColumnStats) -> dd.DataFrame:
    """Impute missing features with the train mean, then centre and scale by train std."""
    scaled: dd.DataFrame = frame.map_partitions(_standardise_part, features, stats.mean, stats.std)
    return scaled


def column_stats(frame: dd.DataFrame) -> ColumnStats:
    """Mean, std (``DDOF``) and non-missing count of every column, across partitions."""
    from dask.base import compute

    return _finish_stats(*compute(*_column_stats_graph(frame)))


def _column_stats_graph(frame: dd.DataFrame) -> tuple[dd.Series, dd.Series, dd.Series]:
    """Lazy mean, sum of squared deviations and count: two passes, numerically stable.

    Summed in float64: float32 sums round at 1e-7, so the statistics (and every standardised
    value) would depend on how the rows happen to be partitioned, in process or on a cluster.
    """
    frame = frame.astype("float64")
    mean = frame.mean()
    return mean, ((frame - mean) ** 2).sum(), frame.count()


def _finish_stats(mean: pd.Series, squares: pd.Series, count: pd.Series) -> ColumnStats:
    """Std from the squared deviations; an all-missing or constant column scales by 1."""
    std = (squares / (count - DDOF)) ** 0.5
    std = std.where(std > 0, 1.0).fillna(1.0)
    return ColumnStats(mean=mean.fillna(0.0), std=std, count=count)


def _part_name(index: int) -> str:
    """Zero-padded part names, so that lexicographic order (pyarrow's) is partition order."""
    return f"part-{index:05d}.parquet"


def _select(tagged: dd.DataFrame, split: str) -> dd.DataFrame:
    """The rows of one split, without the split column."""
    rows: dd.DataFrame = tagged[tagged[SPLIT_COLUMN] == split].drop(columns=[SPLIT_COLUMN])
    return rows


def _uniform_keys(part: pd.DataFrame, seed: int) -> npt.NDArray[np.float64]:
    """A uniform [0, 1) key per row from its values and the seed (splitmix64 finaliser)."""
    import numpy as np
    import pandas as pd

    z = pd.util.hash_pandas_object(part, index=False).to_numpy(dtype=np.uint64)
    z = z + np.uint64((seed * _GOLDEN) & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _split_keys(part: pd.DataFrame, label: str, seed: int) -> pd.DataFrame:
    """Per row: its label, its key ``u`` and the histogram bin of the key."""
    import pandas as pd

    u = _uniform_keys(part, seed)
    return pd.DataFrame(
        {label: part[label].to_numpy(), "u": u, "bin": (u * _BINS).astype("int64")},
        index=part.index,
    )


def _cut_ranks(counts: pd.Series, fractions: Fractions) -> dict[Any, list[tuple[int, int]]]:
    """Per class, the two cut points (test|valid, valid|train) as (bin, rank within the bin).

    A class of ``n`` rows puts its ``round(n * test)`` smallest keys in test and the next
    ``round(n * (test + valid)) - round(n * test)`` in valid; bin -1 means "past the end".
    """
    import numpy as np

    cuts: dict[Any, list[tuple[int, int]]] = {}
    for cls, per_bin in counts.groupby(level=0):
        bins = per_bin.index.get_level_values(1).to_numpy()
        cum = np.cumsum(per_bin.to_numpy())
        n = int(cum[-1])
        ranks = (round(n * fractions.test), round(n * (fractions.test + fractions.valid)))
        cuts[cls] = []
        for rank in ranks:
            at = int(np.searchsorted(cum, rank, side="right"))
            before = int(cum[at - 1]) if at > 0 else 0
            cuts[cls].append((int(bins[at]) if at < len(bins) else -1, rank - before))
    return cuts


def _bins_of(cuts: dict[Any, list[tuple[int, int]]]) -> set[tuple[Any, int]]:
    """The (class, bin) pairs whose keys are needed to place the cut points exactly."""
    return {(cls, b) for cls, points in cuts.items() for b, _ in points if b >= 0}


def _in_bins(part: pd.DataFrame, label: str, pairs: list[tuple[Any, int]]) -> pd.Series:
    """Whether each row's (label, bin) is one of ``pairs``."""
    import pandas as pd

    index = pd.MultiIndex.from_arrays([part[label], part["bin"]])
    return pd.Series(index.isin(pairs), index=part.index)


def _thresholds(
    cuts: dict[Any, list[tuple[int, int]]], boundary: pd.DataFrame, label: str
) -> dict[Any, tuple[float, float]]:
    """Per class, the keys below which a row goes to test, and to test or valid."""
    result: dict[Any, tuple[float, float]] = {}
    for cls, points in cuts.items():
        keys = boundary[boundary[label] == cls]
        edges = []
        for b, rank_in_bin in points:
            in_bin = keys.loc[keys["bin"] == b, "u"].sort_values().to_numpy()
            edges.append(float(in_bin[rank_in_bin]) if b >= 0 else float("inf"))
        result[cls] = (edges[0], edges[1])
    return result


def _tag_split(part: pd.DataFrame, label: str, seed: int, thresholds: dict[Any, tuple[float, float]]) -> pd.DataFrame:
    """Add the ``split`` column to one partition from the per-class thresholds."""
    import numpy as np

    u = _uniform_keys(part, seed)
    test_edge = part[label].map({cls: t[0] for cls, t in thresholds.items()}).to_numpy(float)
    valid_edge = part[label].map({cls: t[1] for cls, t in thresholds.items()}).to_numpy(float)
    names = np.where(u < test_edge, "test", np.where(u < valid_edge, "valid", "train"))
    return part.assign(**{SPLIT_COLUMN: names})


def _standardise_part(part: pd.DataFrame, features: list[str], mean: pd.Series, std: pd.Series) -> pd.DataFrame:
    """Impute and scale the feature columns of one partition."""
    scaled = standardise_rows(part, features, mean, std)
    return part.assign(**{column: scaled[column] for column in features})


def standardise_rows(rows: pd.DataFrame, features: list[str], mean: pd.Series, std: pd.Series) -> pd.DataFrame:
    """The feature columns of ``rows``, missing values imputed with the train mean, centred and
    scaled by the train std: what the models were trained on (predict applies it to raw rows).
    Values beyond :data:`SCALED_LIMIT` standard deviations are clipped to it: float32 models
    (xgboost, torch) would otherwise see infinities where an absurd raw value overflows."""
    scaled = (rows[features].fillna(mean[features]) - mean[features]) / std[features]
    return scaled.clip(-SCALED_LIMIT, SCALED_LIMIT)


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
