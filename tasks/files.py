"""Small helpers for writing a stage's outs: parents created, JSON written one way."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def out_file(path: Path) -> Path:
    """``path`` with its parent directory created (the runner's temporary sibling may be new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Indented JSON with a trailing newline: stable bytes, readable diffs."""
    out_file(path).write_text(json.dumps(body, indent=2) + "\n")
