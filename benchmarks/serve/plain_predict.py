"""The peer of `conveyor predict` a user would write: one process, pandas, the project's own scorer.

``python plain_predict.py PROJECT INPUT OUTPUT``: load the model once with the functions the
project's spec names (its ``model:`` section: the files, ``load`` and ``predict``), read the
whole parquet file, score it in one call, write ``row`` and ``score`` to OUTPUT (parquet),
as ``conveyor predict`` does for a model without an id column. No dask, no conveyor.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def function(name: str) -> Callable[..., Any]:
    module, _, attribute = name.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
    return found


def main(project: Path, source: Path, output: Path) -> None:
    import pandas as pd
    import yaml

    sys.path.insert(0, str(project))
    model = yaml.safe_load((project / "configs/pipeline.yaml").read_text(encoding="utf-8"))["model"]
    features_file, _, key = str(model["features"]).partition(":")
    features = json.loads((project / features_file).read_text(encoding="utf-8"))[key]
    scorer = function(model["load"])({name: project / path for name, path in model["files"].items()})
    rows = pd.read_parquet(source, columns=features)
    scores = function(model["predict"])(scorer, rows)
    pd.DataFrame({"row": range(len(rows)), "score": scores}).to_parquet(output, index=False)


if __name__ == "__main__":
    main(*(Path(arg).resolve() for arg in sys.argv[1:4]))
