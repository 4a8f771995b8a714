"""Run the breast-cancer pipeline, or some of its stages, as one Prefect flow run."""

from __future__ import annotations

from typing import Any

from prefect import State, flow

import conveyor


@flow(name="breast-cancer", flow_run_name=conveyor.pipeline_run_name, persist_result=False, log_prints=True)
def pipeline(spec: str = "configs/pipeline.yaml", stages: list[str] | None = None, downstream: bool = False,
             force: bool = False, profile: dict[str, str] | None = None,
             set_params: list[str] | None = None) -> State[Any]:
    """Each stage is a task run; unchanged stages are skipped (as `conveyor run STAGE... [--downstream] [--force]`).

    ``set_params``: ``["train.eta=0.3"]`` sets params first, as `conveyor run -S train.eta=0.3`.
    """
    return conveyor.run_stages(spec, stages=stages, downstream=downstream, force=force, profile=profile,
                               set_params=set_params)
