"""Weekly retraining: new data in, the stacked model promoted only when it beats the champion."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from prefect import State, flow
from pydantic import Field

import conveyor


@flow(name="breast-cancer-retrain", flow_run_name=conveyor.retrain_run_name, persist_result=False, log_prints=True)
def retrain(spec: str = "configs/pipeline.yaml",
            ingest: list[str] | None = None,
            metric: str = "metrics/test.json:stack.auc",
            direction: Literal["max", "min"] = "max",
            min_delta: Annotated[float, Field(ge=0)] = 0.002,
            model: str = "models/stack.json",
            registry: str = "models/registry.json",
            profile: dict[str, str] | None = None) -> State[Any]:
    """Re-ingest (the ``ingest`` stages, by default those with no upstream), rerun what changed, and
    promote the stack when its test AUC beats the champion's in models/registry.json by ``min_delta``."""
    return conveyor.retrain(spec, metric=metric, model=model, ingest=ingest, direction=direction,
                            min_delta=min_delta, registry=registry, profile=profile)
