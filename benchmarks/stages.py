"""Calling a task the way conveyor's runner does, without the runner: a hand-built StageContext."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor import StageContext

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client


def context(stage: str, root: Path, *, params: Mapping[str, Any], deps: Mapping[str, Path] | None = None,
            outs: Mapping[str, Path] | None = None, client: Client | None = None, executor: Executor | None = None,
            n_workers: int = 1, metrics: Mapping[str, Path] | None = None) -> StageContext:
    """The StageContext the runner would build (``outs`` map declared paths to where to write)."""
    return StageContext(stage=stage, params=dict(params), deps=dict(deps or {}), outs=dict(outs or {}),
                        metrics=dict(metrics or {}), root=root, log=logging.getLogger(f"benchmarks.{stage}"),
                        client=client, executor=executor, n_workers=n_workers)


def current(client: Client | None) -> Any:
    """Make ``client`` the current Dask client for the task, as the runner does."""
    return client.as_current() if client is not None else nullcontext()


def read_parts(folder: Path) -> pd.DataFrame:
    """Every ``*.parquet`` under ``folder`` (recursively, in path order), as one frame."""
    import pandas as pd

    parts = sorted(folder.rglob("*.parquet"))
    if not parts:
        return pd.DataFrame()
    return pd.concat([pd.read_parquet(part) for part in parts], ignore_index=True)


def digest(frame: pd.DataFrame) -> str:
    """A content hash of a frame's columns, values and row order (not its index)."""
    import pandas as pd

    h = hashlib.sha256(",".join(f"{c}:{t}" for c, t in frame.dtypes.astype(str).items()).encode())
    h.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    return h.hexdigest()[:16]
