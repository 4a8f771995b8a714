"""Deterministic training: the same seed gives the same bytes, run after run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deterministic_torch(seed: int | None = None, *, warn_only: bool = False) -> Iterator[None]:
    """Deterministic torch kernels, and (given a seed) a seeded RNG, for the duration of the call.

    Both are process-wide in torch: the previous settings and RNG state come back on exit,
    so stages running at once in one process do not leak into each other's runs.
    ``warn_only``: ops without a deterministic kernel warn instead of raising (on GPUs,
    where cuBLAS may have been set up before ``CUBLAS_WORKSPACE_CONFIG`` was).
    """
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)
