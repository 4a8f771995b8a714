"""The service a user would write instead of `conveyor serve-model`: the baseline of serve-latency.

``python bare_service.py PROJECT [--host 127.0.0.1] [--port 0]``: the reference project's model loaded
once with its ``tasks.predict.load`` (the files of its spec's ``model:`` section, written out here),
``POST /predict`` ``{"rows": [{feature: number, ...}]}`` answered ``{"scores": [...]}`` by
``tasks.predict.score`` on a DataFrame of the rows (the model's column order), ``GET /health``. A plain
FastAPI app with a plain ``def`` endpoint (FastAPI's thread pool), run by ``uvicorn.run(app, host, port)``:
uvicorn's defaults, access log included; with ``--port 0`` uvicorn logs the port it took. No conveyor,
prefect or dask is imported.
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

FILES = {"stats": "data/processed/stats.json", "xgb": "models/xgb.json", "mlp": "models/mlp.pt",
         "stack": "models/stack.json"}  # configs/pipeline.yaml's model: section


class PredictRequest(BaseModel):
    rows: list[dict[str, float]]


def create_app(project: Path) -> FastAPI:
    sys.path.insert(0, str(project))
    from tasks import predict  # the project's own scoring code

    features = list(json.loads((project / FILES["stats"]).read_text(encoding="utf-8"))["features"])
    scorer = predict.load({name: project / path for name, path in FILES.items()})
    app = FastAPI(title="breast-cancer model")
    app.get("/health")(lambda: {"status": "ok"})

    @app.post("/predict")
    def score(request: PredictRequest) -> dict[str, list[float]]:
        return {"scores": predict.score(scorer, pd.DataFrame(request.rows, columns=features)).tolist()}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path, help="a trained copy of the reference project")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free one (uvicorn logs which)")
    args = parser.parse_args()
    uvicorn.run(create_app(args.project.resolve()), host=args.host, port=args.port)
