"""Column statistics that add up across partitions: count, mean and sum of squared deviations
per column, combined by Chan et al.'s parallel update, in float64, NaNs skipped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

DDOF = 1  # sample standard deviation, as pandas' default


@dataclass(frozen=True)
class ColumnStats:
    """Train-split statistics of the feature columns (NaNs skipped, ``DDOF`` for std)."""

    mean: pd.Series
    std: pd.Series
    count: pd.Series


@dataclass(frozen=True)
class Moments:
    """Per column: non-missing count, mean and sum of squared deviations (float64).

    Two sets add as Chan et al.'s parallel update, which keeps the precision of a two-pass
    computation whatever the partitioning (a sum of squares would not: it cancels when the
    mean is large against the spread).
    """

    count: npt.NDArray[np.float64]
    mean: npt.NDArray[np.float64]
    m2: npt.NDArray[np.float64]

    @classmethod
    def of(cls, values: npt.NDArray[Any]) -> Moments:
        """The moments of the columns of a 2-d numeric array, in float64, NaNs skipped."""
        import numpy as np

        values = np.array(values, dtype=np.float64, order="K")  # one copy, worked on in place
        missing = np.isnan(values)
        count = (len(values) - missing.sum(axis=0)).astype(np.float64)
        skip = bool(missing.any())
        if skip:
            values[missing] = 0.0
        mean = np.divide(values.sum(axis=0), count, out=np.zeros(values.shape[1]), where=count > 0)
        values -= mean
        if skip:
            values[missing] = 0.0
        return cls(count=count, mean=mean, m2=np.einsum("ij,ij->j", values, values))

    def __add__(self, other: Moments) -> Moments:
        import numpy as np

        count = self.count + other.count
        delta = other.mean - self.mean
        share = np.divide(other.count, count, out=np.zeros_like(count), where=count > 0)
        return Moments(count=count, mean=self.mean + delta * share,
                       m2=self.m2 + other.m2 + delta**2 * self.count * share)

    def stats(self, columns: Sequence[str]) -> ColumnStats:
        """Mean and std (``DDOF``); an all-missing or constant column has mean 0 and std 1."""
        import numpy as np
        import pandas as pd

        with np.errstate(divide="ignore", invalid="ignore"):
            std = np.sqrt(self.m2 / (self.count - DDOF))
        std = np.where(np.isfinite(std) & (std > 0), std, 1.0)
        return ColumnStats(mean=pd.Series(np.where(self.count > 0, self.mean, 0.0), index=list(columns)),
                           std=pd.Series(std, index=list(columns)),
                           count=pd.Series(self.count.astype(np.int64), index=list(columns)))
