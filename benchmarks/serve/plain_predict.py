"""The peer of `conveyor predict` a user would write: one process, pandas, the project's own scorer.

``python plain_predict.py PROJECT INPUT OUTPUT``: load the model once as the spec's ``model:`` section says
(its files, ``load``, ``predict``), score the whole parquet file in one call, write ``row`` and ``score``
(parquet), as ``conveyor predict`` does for a model without an id column. No dask, no conveyor.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_model(project: Path) -> tuple[list[str], Any, Callable[..., Any]]:
    """The model's features, the loaded model and the predict function (the project's root goes on sys.path)."""
    import yaml

    sys.path.insert(0, str(project))
    model = yaml.safe_load((project / "configs/pipeline.yaml").read_text(encoding="utf-8"))["model"]
    load, predict = (getattr(importlib.import_module(m), f) for m, _, f in (model[k].partition(":") for k in
                                                                           ("load", "predict")))
    features_file, _, key = str(model["features"]).partition(":")
    features = list(json.loads((project / features_file).read_text(encoding="utf-8"))[key])
    return features, load({name: project / path for name, path in model["files"].items()}), predict


def main(project: Path, source: Path, output: Path) -> None:
    import pandas as pd

    features, scorer, predict = load_model(project)
    rows = pd.read_parquet(source, columns=features)
    pd.DataFrame({"row": range(len(rows)), "score": predict(scorer, rows)}).to_parquet(output, index=False)


if __name__ == "__main__":
    main(*(Path(arg).resolve() for arg in sys.argv[1:4]))
