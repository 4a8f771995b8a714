"""Who holds DVC's path locks: ``dvc repro`` releases its repository lock while a stage's command
runs and keeps only these (``.dvc/tmp/rwlock``), so a run that took the repository lock asks
them too before it touches dvc.lock."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.workspace import alive


def running_dvc(root: Path) -> list[str]:
    """Live DVC commands holding path locks in the repository at ``root``, as ``"dvc repro (pid 123)"``."""
    path = root / ".dvc" / "tmp" / "rwlock"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    holders = [*data.get("write", {}).values(), *(i for infos in data.get("read", {}).values() for i in infos)]
    return sorted({f"{h.get('cmd', 'dvc')} (pid {h['pid']})" for h in holders
                   if isinstance(h, dict) and alive(int(h.get("pid", 0)))})
