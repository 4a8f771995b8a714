"""JSON written one way: stable bytes, readable diffs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Indented JSON with a trailing newline."""
    path.write_text(json.dumps(body, indent=2) + "\n")
