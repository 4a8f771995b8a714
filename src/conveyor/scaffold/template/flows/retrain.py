"""Scheduled retraining: new data in, the model promoted only when it beats the champion."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from prefect import State, flow
from pydantic import Field

import conveyor


@flow(name="__project__-retrain", flow_run_name=conveyor.retrain_run_name, persist_result=False, log_prints=True)
def retrain(spec: str = "configs/pipeline.yaml",
            ingest: list[str] | None = None,
            metric: str = "metrics/train.json:r2",
            direction: Literal["max", "min"] = "max",
            min_delta: Annotated[float, Field(ge=0)] = 0.001,
            model: str = "models/model.json",
            registry: str = "models/registry.json",
            profile: dict[str, str] | None = None) -> State[Any]:
    """Re-run the stages with no upstream (new data), rerun what changed, and promote the model
    when its test r2 beats the champion's in models/registry.json by ``min_delta``."""
    return conveyor.retrain(spec, metric=metric, model=model, ingest=ingest, direction=direction,
                            min_delta=min_delta, registry=registry, profile=profile)
