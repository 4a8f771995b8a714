"""A bench to run tasks the way conveyor's runner runs them, without the runner.

``StageBench.run`` builds the ``StageContext`` by hand (declared params, deps, outs written
to temporary siblings, the Dask client made current), calls the task, then renames the
outs into place. ``run_chain`` runs the reference pipeline's stages in order.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed import Client, LocalCluster

from conveyor.ingest import fetch as ingest
from conveyor.run.context import StageContext
from tasks import evaluate, preprocess, train

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
        dashboard_address=":0",
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
    """A project root where stages run like the runner runs them.

    Outs and metrics are written to temporary siblings whose names do not keep the
    declared suffix (``xgb.json.tmp-1a2b``), then renamed into place after the task
    returned: tasks must not rely on the file name they are given.
    """

    root: Path
    params: dict[str, Any]
    contexts: list[StageContext] = field(default_factory=list)

    def run(
        self,
        task: Task,
        *,
        params: Sequence[str] = (),
        deps: Sequence[str] = (),
        outs: Sequence[str] = (),
        metrics: Sequence[str] = (),
        client: Client | None = None,
        executor: Executor | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> StageContext:
        """Run one task; ``overrides`` replaces whole declared keys of params.yaml."""
        tmp = {rel: self.root / f"{rel}.tmp-{uuid.uuid4().hex[:4]}" for rel in (*outs, *metrics)}
        ctx = StageContext(
            stage=task.__name__,
            params={key: (overrides or {}).get(key, lookup(self.params, key)) for key in params},
            deps={rel: self.root / rel for rel in deps},
            outs={rel: tmp[rel] for rel in outs},
            metrics={rel: tmp[rel] for rel in metrics},
            root=self.root,
            log=logging.getLogger(f"tests.{task.__name__}"),
            client=client,
            executor=executor,
            n_workers=len(client.scheduler_info(n_workers=-1)["workers"]) if client else 1,
        )
        with client.as_current() if client is not None else nullcontext():
            task(ctx)
        for rel, path in tmp.items():
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            path.rename(self.root / rel)
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
        deps=["data/processed", "models/xgb.json", "models/mlp.pt"],
        outs=["models/stack.json"],
    )
    bench.run(
        evaluate.evaluate,
        params=["evaluate"],
        deps=["data/processed", "models/xgb.json", "models/mlp.pt", "models/stack.json"],
        outs=["plots/roc.png"],
        metrics=["metrics/test.json"],
    )
    return bench
