"""The split of rows into train, valid and test: exact, stratified, seeded, and the same
whatever the partitioning and the order of the rows.

Each row gets a uniform key from a hash of its values and the seed (:func:`split_keys`);
within each class the rows with the smallest keys go to test, the next ones to valid, the rest
to train, so every class contributes ``round(n_class * fraction)`` rows to each split (exact
stratification, not Spark ``sampleBy``'s per-row coin flips; rows with identical values share
a key and so a split). The cut points come from a histogram of the keys per class
(:func:`key_histogram`, :func:`cut_points`) and the keys in the few bins that hold one
(:func:`thresholds`). Everything here works on one part (plain pandas and numpy): the
preprocess stage runs it per partition and adds the results up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

SPLITS = ("train", "valid", "test")  # also the split codes: 0 train, 1 valid, 2 test
TRAIN, VALID, TEST = range(3)
_BINS = 1 << 12  # histogram resolution of the split key when locating per-class cut points
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

Cuts = dict[Any, tuple[tuple[int, int], tuple[int, int]]]  # per class: (bin, rank in bin) of test|valid, valid|train
Thresholds = dict[Any, tuple[float, float]]  # per class: keys below which a row is test, and test or valid


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


def split_keys(part: pd.DataFrame, seed: int) -> npt.NDArray[np.float64]:
    """A uniform [0, 1) key per row from its values and the seed (splitmix64 finaliser)."""
    import numpy as np
    import pandas as pd

    z = pd.util.hash_pandas_object(part, index=False).to_numpy(dtype=np.uint64)
    z = z + np.uint64((seed * _GOLDEN) & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def key_bins(keys: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """The histogram bin of each key."""
    import numpy as np

    return (keys * _BINS).astype(np.int64)


def key_histogram(labels: npt.NDArray[Any], keys: npt.NDArray[np.float64]) -> dict[Any, npt.NDArray[np.int64]]:
    """Per class, the number of keys in each of the ``_BINS`` bins."""
    import numpy as np

    classes, index = np.unique(labels, return_inverse=True)
    counts = np.bincount(index.ravel() * _BINS + key_bins(keys), minlength=len(classes) * _BINS)
    return dict(zip(classes.tolist(), counts.reshape(len(classes), _BINS), strict=True))


def cut_points(histogram: Mapping[Any, npt.NDArray[np.int64]], fractions: Fractions) -> Cuts:
    """Per class, the two cut points (test|valid, valid|train) as (bin, rank within the bin).

    A class of ``n`` rows puts its ``round(n * test)`` smallest keys in test and the next
    ``round(n * (test + valid)) - round(n * test)`` in valid; bin -1 means "past the end".
    """
    import numpy as np

    cuts: Cuts = {}
    for cls, per_bin in histogram.items():
        cum = np.cumsum(per_bin)
        n = int(cum[-1])
        points = []
        for rank in (round(n * fractions.test), round(n * (fractions.test + fractions.valid))):
            at = int(np.searchsorted(cum, rank, side="right"))
            before = int(cum[at - 1]) if at > 0 else 0
            points.append((at if at < len(cum) else -1, rank - before))
        cuts[cls] = (points[0], points[1])
    return cuts


def thresholds(cuts: Cuts, labels: npt.NDArray[Any], keys: npt.NDArray[np.float64],
               bins: npt.NDArray[np.int64]) -> Thresholds:
    """Per class, the keys below which a row goes to test, and to test or valid, from the rows in
    the bins that hold the cut points (their ``labels``, ``keys`` and ``bins``)."""
    import numpy as np

    result: Thresholds = {}
    for cls, points in cuts.items():
        of_class = labels == cls
        edges = []
        for b, rank_in_bin in points:
            in_bin = np.sort(keys[of_class & (bins == b)])
            edges.append(float(in_bin[rank_in_bin]) if b >= 0 else float("inf"))
        result[cls] = (edges[0], edges[1])
    return result


def past_end(b: int) -> int:
    """A cut's bin, with "past the end" (-1) as the bin after the last: no row's bin is past it."""
    return b if b >= 0 else _BINS


def split_codes(labels: pd.Series, keys: npt.NDArray[np.float64], limits: Thresholds) -> npt.NDArray[np.int8]:
    """Each row's split as its index in ``SPLITS`` (0 train, 1 valid, 2 test)."""
    import numpy as np

    test_edge = labels.map({cls: t[0] for cls, t in limits.items()}).to_numpy(np.float64)
    valid_edge = labels.map({cls: t[1] for cls, t in limits.items()}).to_numpy(np.float64)
    codes = np.full(len(keys), TRAIN, dtype=np.int8)
    codes[keys < valid_edge] = VALID
    codes[keys < test_edge] = TEST
    return codes


def class_counts(codes: npt.NDArray[np.int8], labels: pd.Series) -> pd.Series:
    """Rows per (split name, class)."""
    import numpy as np
    import pandas as pd

    classes, index = np.unique(labels.to_numpy(), return_inverse=True)
    counts = np.bincount(codes.astype(np.int64) * len(classes) + index.ravel(), minlength=len(SPLITS) * len(classes))
    return pd.Series(counts, index=pd.MultiIndex.from_product([list(SPLITS), classes.tolist()]))
