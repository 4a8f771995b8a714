"""The numbers in a stage's declared metrics files, flattened as ``dvc metrics show`` shows them.

JSON, YAML and TOML files hold nested mappings: ``{"test": {"auc": 0.99}}`` becomes
``test.auc: 0.99``. Only numbers are metrics; other values and unreadable files are left out
(a metrics file is the stage's business, a summary must not fail on it).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from conveyor.spec.yamlmap import load_yaml


def read_metrics(path: Path) -> dict[str, float]:
    """Numbers of one metrics file, by dotted key; empty when missing or unreadable."""
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:  # bounded: a stage's output is read as carefully as a spec
            data = load_yaml(path).data
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return dict(numbers(data))


def numbers(data: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in ``data`` by dotted key (``test.auc``); booleans are not numbers."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            yield from numbers(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, int | float) and not isinstance(data, bool):
        yield prefix, float(data)


def stage_metrics(root: Path, declared: Iterable[str]) -> dict[str, float]:
    """All numbers of a stage's metrics files; keys carry the file when a stage has several."""
    files = list(declared)
    found: dict[str, float] = {}
    for rel in files:
        for key, value in read_metrics(root / rel).items():
            found[f"{rel}:{key}" if len(files) > 1 else key] = value
    return found
