"""A bench to run tasks the way conveyor's runner runs them, without the runner.

``StageBench.run`` builds the ``StageContext`` by hand (declared params, deps and outs in
place, names, the Dask client made current) and calls the task inside the outs journal,
as the runner does. ``run_chain`` runs the reference pipeline's stages in order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed import Client, LocalCluster

from conveyor import StageContext
from conveyor.run.journal import Journal
from conveyor.run.stage import check_outs, current_client
from tasks import evaluate, ingest, preprocess, train

REPO = Path(__file__).resolve().parents[2]
Task = Callable[[StageContext], None]


def new_cluster() -> LocalCluster:
    """The `cpu` profile of the reference pipeline, on loopback; no dashboard, and the
    scheduler's HTTP server on a free port (``dashboard_address=None`` still binds 8787)."""
    return LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        scheduler_kwargs={"dashboard": False},
    )


def lookup(params: Mapping[str, Any], dotted: str) -> Any:
    """``params["train"]["xgb"]`` for ``"train.xgb"``, as the runner resolves declared keys."""
    value: Any = params
    for part in dotted.split("."):
        value = value[part]
    return value


@dataclass
class StageBench:
    """A project root where stages run like the runner runs them: outs in place, the previous
    ones kept aside by the journal and put back if the task raises."""

    root: Path
    params: dict[str, Any]
    contexts: list[StageContext] = field(default_factory=list)

    def run(
        self,
        task: Task,
        *,
        params: Sequence[str] = (),
        deps: Sequence[str] | Mapping[str, str] = (),
        outs: Sequence[str] = (),
        metrics: Sequence[str] = (),
        client: Client | None = None,
        executor: Executor | None = None,
        overrides: Mapping[str, Any] | None = None,
        devices: tuple[int, ...] = (),
    ) -> StageContext:
        """Run one task; ``overrides`` replaces whole declared keys of params.yaml; named deps as a mapping."""
        names = dict(deps) if isinstance(deps, Mapping) else {}
        dep_paths = list(deps.values()) if isinstance(deps, Mapping) else list(deps)
        ctx = StageContext(
            stage=task.__name__,
            params={key: (overrides or {}).get(key, lookup(self.params, key)) for key in params},
            deps={rel: self.root / rel for rel in dep_paths},
            outs={rel: self.root / rel for rel in outs},
            metrics={rel: self.root / rel for rel in metrics},
            names=names,
            root=self.root,
            log=logging.getLogger(f"tests.{task.__name__}"),
            client=client,
            executor=executor,
            n_workers=len(client.scheduler_info(n_workers=-1)["workers"]) if client else 1,
            devices=devices,
        )
        with Journal(self.root).protect(task.__name__, [*outs, *metrics]), \
                current_client(client) if client is not None else nullcontext():
            task(ctx)
            check_outs(self.root, task.__name__, [*outs, *metrics])
        self.contexts.append(ctx)
        return ctx

    def json(self, rel: str) -> Any:
        return json.loads((self.root / rel).read_text())


def run_chain(bench: StageBench, client: Client) -> StageBench:
    """ingest -> preprocess -> train_xgb -> train_mlp -> stack -> evaluate, as in the spec.

    preprocess and train_xgb get the cluster (profiles `cpu`, and `gpu` falling back to
    `cpu`); ingest gets no executor (it makes its own pool), the rest run in-process.
    """
    bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"])
    bench.run(
        preprocess.prepare,
        params=["preprocess", "seed"],
        deps=["data/raw"],
        outs=["data/processed"],
        client=client,
    )
    bench.run(
        train.xgboost_model,
        params=["train.xgb", "seed"],
        deps=["data/processed"],
        outs=["models/xgb.json"],
        metrics=["metrics/train_xgb.json"],
        client=client,
    )
    bench.run(
        train.mlp_model,
        params=["train.mlp", "seed"],
        deps=["data/processed"],
        outs=["models/mlp.pt"],
        metrics=["metrics/train_mlp.json"],
    )
    bench.run(
        train.stack,
        params=["train.stack", "seed"],
        deps={"data": "data/processed", "xgb": "models/xgb.json", "mlp": "models/mlp.pt"},
        outs=["models/stack.json"],
    )
    bench.run(
        evaluate.evaluate,
        params=["evaluate"],
        deps={"data": "data/processed", "xgb": "models/xgb.json", "mlp": "models/mlp.pt",
              "stack": "models/stack.json"},
        outs=["plots/roc.png"],
        metrics=["metrics/test.json"],
    )
    return bench
