"""conveyor: declarative ML pipelines run as Prefect flows on threads, Dask and GPUs, versioned with DVC.

The public API a project's tasks and flows use is what this module exports; everything
else is conveyor's own and may change between releases.
"""

from __future__ import annotations

from conveyor.run.context import StageContext, StageProgress

__all__ = ["StageContext", "StageProgress", "__version__"]

__version__ = "0.1.0"
