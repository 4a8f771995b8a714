"""conveyor: declarative ML pipelines run as Prefect flows on threads, Dask and GPUs, versioned with DVC.

The public API, for a project's tasks and flows:

- ``StageContext``, ``StageProgress``, ``MatrixItem``: what a task ``fn(ctx) -> None`` receives
  (``ctx.items("train")``: the items of a matrix stage it needs);
- ``run_stages``, ``retrain``, ``pipeline_run_name``, ``retrain_run_name``: what a project's
  Prefect flows (``flows/``) call, inside a ``@flow``;
- libraries for tasks: :mod:`conveyor.ingest` (many sources on a thread pool),
  :mod:`conveyor.train` (xgboost.dask, torch DDP on Dask workers, deterministic seeds).

Every name loads on first use: the flow helpers import Prefect, so a task importing
``StageContext`` pays for nothing else, and the ``conveyor`` command's entry
(:mod:`conveyor.cli.warm`, on every run's path) for nothing at all.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing alone takes 6 ms of every command's start
if TYPE_CHECKING:
    from typing import Any

    from conveyor.prefect.flow import pipeline_run_name, run_stages
    from conveyor.prefect.retrain import retrain, retrain_run_name
    from conveyor.run.context import MatrixItem, StageContext, StageProgress

__all__ = ["MatrixItem", "StageContext", "StageProgress", "__version__", "pipeline_run_name", "retrain",
           "retrain_run_name",
           "run_stages"]

__version__ = "0.1.0"

_LAZY = {"MatrixItem": "conveyor.run.context", "StageContext": "conveyor.run.context",
         "StageProgress": "conveyor.run.context", "run_stages": "conveyor.prefect.flow",
         "pipeline_run_name": "conveyor.prefect.flow", "retrain": "conveyor.prefect.retrain",
         "retrain_run_name": "conveyor.prefect.retrain"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
