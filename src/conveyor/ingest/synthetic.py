"""A synthetic, HIGGS-shaped data set: 28 float features and a binary label, seeded.

The columns follow the UCI HIGGS data set (21 low-level kinematic features of a lepton,
missing energy and four jets, then 7 reconstructed masses), with plausible shapes:
momenta and masses log-normal, pseudorapidities normal, angles uniform, b-tags three-valued.
The label is drawn from ``sigmoid(f(x))`` for a fixed function ``f`` (a linear part, pair
interactions, squares and an angle difference) chosen by the seed: a model can learn it,
a linear one only partly, trees and MLPs better, as on the real data.

Shard ``i`` is generated from its own stream ``SeedSequence(seed, spawn_key=(1, i))``,
so the data set is the same whatever the number of threads or the order they run in.
numpy and pyarrow release the GIL, so shards generated on a thread pool run in parallel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.ingest.parts import write_atomically

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

_LOW_LEVEL = [
    "lepton_pt", "lepton_eta", "lepton_phi", "missing_energy_magnitude", "missing_energy_phi",
    *(f"jet{j}_{q}" for j in range(1, 5) for q in ("pt", "eta", "phi", "btag")),
]
FEATURES = [*_LOW_LEVEL, "m_jj", "m_jjj", "m_lv", "m_jlv", "m_bb", "m_wbb", "m_wwbb"]
ANGLES = [i for i, name in enumerate(FEATURES) if name.endswith("_phi")]
_KNOWN_KEYS = {"kind", "rows", "shards", "seed", "label", "dtype"}
_BTAG_STEP = 1.0865  # HIGGS b-tag values: 0, 1.0865, 2.1730


@dataclass(frozen=True)
class SyntheticSource:
    """``{kind: synthetic, rows: N, shards: M, seed: S}`` in ``ingest.sources``."""

    rows: int
    shards: int
    seed: int
    label: str = "target"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.rows < 1 or not 1 <= self.shards <= self.rows:
            raise ValueError(f"synthetic source: need rows >= 1 and 1 <= shards <= rows, "
                             f"got rows={self.rows}, shards={self.shards}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"synthetic source: dtype must be float32 or float64, got {self.dtype!r}")
        if self.label in FEATURES:
            raise ValueError(f"synthetic source: label {self.label!r} is a feature name")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SyntheticSource:
        unknown = sorted(set(params) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"synthetic source: unknown keys {unknown} (known: {sorted(_KNOWN_KEYS)})")
        missing = sorted({"rows", "shards", "seed"} - set(params))
        if missing:
            raise ValueError(f"synthetic source: missing {missing}")
        return cls(rows=int(params["rows"]), shards=int(params["shards"]), seed=int(params["seed"]),
                   label=str(params.get("label", "target")), dtype=str(params.get("dtype", "float32")))

    def shard_rows(self, shard: int) -> int:
        """Rows of shard ``shard``: as even as can be, the first ones one row longer."""
        base, extra = divmod(self.rows, self.shards)
        return base + (1 if shard < extra else 0)

    def shard_bytes(self, shard: int) -> int:
        """Bytes of the shard's columns in memory (what progress counts)."""
        width = 4 if self.dtype == "float32" else 8
        return self.shard_rows(shard) * (len(FEATURES) * width + 8)

    @cached_property
    def concept(self) -> Concept:
        return Concept.draw(self.seed)


@dataclass(frozen=True, eq=False)
class Concept:
    """The fixed function behind the label: which features matter, and how."""

    weights: npt.NDArray[np.float64]  # linear weights on the latent of each feature
    pairs: tuple[tuple[int, int], ...]  # latent products
    squares: tuple[int, ...]  # centred squared latents
    angles: tuple[int, int]  # cos of the difference of these two angles (positions in ANGLES)
    bias: float

    @classmethod
    def draw(cls, seed: int) -> Concept:
        import numpy as np

        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
        latent = [i for i, name in enumerate(FEATURES) if not name.endswith("_phi")]
        weights = np.zeros(len(FEATURES))
        weights[latent] = rng.normal(0.0, 1.0, len(latent)) / np.sqrt(len(latent))
        chosen = [int(i) for i in rng.choice(latent, size=8, replace=False)]
        a, b = (int(i) for i in rng.choice(len(ANGLES), size=2, replace=False))
        return cls(weights, ((chosen[0], chosen[1]), (chosen[2], chosen[3]), (chosen[4], chosen[5])),
                   (chosen[6], chosen[7]), (a, b), bias=0.1)

    def logit(self, z: npt.NDArray[np.float64], phi: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``f`` of the rows: latents ``z`` (n x 28) and angles ``phi`` (n x len(ANGLES))."""
        import numpy as np

        value = z @ self.weights
        for i, j in self.pairs:
            value += 0.7 * z[:, i] * z[:, j]
        for i in self.squares:
            value += 0.5 * (z[:, i] ** 2 - 1.0)
        value += 0.8 * np.cos(phi[:, self.angles[0]] - phi[:, self.angles[1]])
        result: npt.NDArray[np.float64] = 1.6 * value + self.bias
        return result


def generate(source: SyntheticSource, shard: int) -> dict[str, npt.NDArray[Any]]:
    """The columns of one shard: the label first (as in HIGGS), then the 28 features."""
    import numpy as np

    n = source.shard_rows(shard)
    rng = np.random.default_rng(np.random.SeedSequence(source.seed, spawn_key=(1, shard)))
    z = rng.standard_normal((n, len(FEATURES)))
    phi = rng.uniform(-np.pi, np.pi, (n, len(ANGLES)))
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-source.concept.logit(z, phi)))).astype(np.int64)
    columns: dict[str, npt.NDArray[Any]] = {source.label: label}
    for i, name in enumerate(FEATURES):
        column = phi[:, ANGLES.index(i)] if i in ANGLES else _feature(name, z[:, i])
        columns[name] = column.astype(source.dtype)
    return columns


def _feature(name: str, z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The observed value of a (non-angle) feature: a monotone map of its latent."""
    import numpy as np

    if name.endswith("_eta"):
        return z
    if name.endswith("_btag"):
        steps: npt.NDArray[np.float64] = np.digitize(z, [0.4, 1.3]).astype(np.float64) * _BTAG_STEP
        return steps
    scale = 0.35 if name.startswith("m_") else 0.55  # masses are narrower than momenta
    shaped: npt.NDArray[np.float64] = np.exp(scale * z)
    return shaped


def write_shard(source: SyntheticSource, shard: int, path: Path) -> int:
    """Generate one shard into the parquet part ``path``; its number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(generate(source, shard))
    write_atomically(path, lambda tmp: pq.write_table(table, tmp, compression="snappy", write_page_checksum=True))
    return int(table.num_rows)
