"""What a user would write instead of conveyor, with the project's own code (no conveyor, prefect or dask):
``plain.py predict PROJECT INPUT OUTPUT`` scores a parquet file in one call (``row``, ``score``, as `conveyor predict`);
``plain.py serve PROJECT PORT`` is a bare FastAPI app (``POST /predict`` of ``{"rows": [...]}``, ``GET /health``)."""

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml


def load_model(project: Path) -> tuple[list[str], Any, Callable[..., Any]]:
    """The features, the model loaded once and the predict function, as the spec's ``model:`` section says."""
    sys.path.insert(0, str(project))
    model = yaml.safe_load((project / "configs/pipeline.yaml").read_text(encoding="utf-8"))["model"]
    load, predict = (getattr(importlib.import_module(m), f) for m, _, f in (model[k].partition(":") for k in
                                                                           ("load", "predict")))
    features_file, _, key = str(model["features"]).partition(":")
    features = list(json.loads((project / features_file).read_text(encoding="utf-8"))[key])
    return features, load({name: project / path for name, path in model["files"].items()}), predict


def serve(project: Path, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel

    class PredictRequest(BaseModel):
        rows: list[dict[str, float]]
    features, scorer, predict = load_model(project)
    app = FastAPI(title="breast-cancer model")
    app.get("/health")(lambda: {"status": "ok"})

    @app.post("/predict")
    def score(request: PredictRequest) -> dict[str, list[float]]:
        return {"scores": predict(scorer, pd.DataFrame(request.rows, columns=features)).tolist()}
    uvicorn.run(app, host="127.0.0.1", port=port)


if __name__ == "__main__" and sys.argv[1] == "serve":
    serve(Path(sys.argv[2]).resolve(), int(sys.argv[3]))
elif __name__ == "__main__":
    features, scorer, predict = load_model(Path(sys.argv[2]).resolve())
    rows = pd.read_parquet(sys.argv[3], columns=features)
    pd.DataFrame({"row": range(len(rows)), "score": predict(scorer, rows)}).to_parquet(sys.argv[4], index=False)
