"""The service a user would write instead of `conveyor serve-model`: the baseline of serve-latency.

``python bare_service.py PROJECT [--host 127.0.0.1] [--port 0]``: load the reference project's
model once with its own ``tasks.predict.load`` (the files its spec's ``model:`` section
lists, written out here as a user would), then answer ``POST /predict``
``{"rows": [{feature: number, ...}, ...]}`` with ``{"scores": [...]}`` from
``tasks.predict.score`` on a DataFrame of the rows, columns in the model's order. ``GET
/health`` says it is up.

A plain FastAPI app on uvicorn with uvicorn's defaults (``uvicorn.run(app, host, port)``
passes nothing else: the same settings as ``uvicorn app:app --host ... --port ...``, the
access log included); its endpoint is a plain ``def``, which FastAPI runs on its thread
pool, as the FastAPI documentation advises for blocking work. With ``--port 0`` uvicorn
takes a free port and says which on stderr (``Uvicorn running on http://HOST:PORT``).
No conveyor, prefect or dask is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

# configs/pipeline.yaml's model: section
FILES = {"stats": "data/processed/stats.json", "xgb": "models/xgb.json", "mlp": "models/mlp.pt",
         "stack": "models/stack.json"}


class PredictRequest(BaseModel):
    rows: list[dict[str, float]]


class Scores(BaseModel):
    scores: list[float]


def create_app(project: Path) -> FastAPI:
    """The app, with the project's model loaded once (the project's root goes on ``sys.path``)."""
    sys.path.insert(0, str(project))
    from tasks import predict  # the project's own scoring code

    features = list(json.loads((project / FILES["stats"]).read_text(encoding="utf-8"))["features"])
    scorer = predict.load({name: project / path for name, path in FILES.items()})
    app = FastAPI(title="breast-cancer model")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/predict")
    def score(request: PredictRequest) -> Scores:
        frame = pd.DataFrame(request.rows, columns=features)
        return Scores(scores=predict.score(scorer, frame).tolist())

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path, help="a trained copy of the reference project")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free one (uvicorn logs which)")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.project.resolve()), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
