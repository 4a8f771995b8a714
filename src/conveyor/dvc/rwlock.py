"""DVC's locks as a run holds and meets them. Who holds DVC's path locks: ``dvc repro`` releases its
repository lock while a stage's command runs and keeps only these (``.dvc/tmp/rwlock``), so a
run that took the repository lock asks them too before it touches dvc.lock."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from conveyor.workspace import alive, kept_from_forks


def kept_from_forks_of_the_run(repo: Any) -> AbstractContextManager[None]:
    """While the run holds DVC's repository lock (zc.lockfile's flock, as DVC takes it), a task's
    fork does not keep it: after a kill -9 of the run, `dvc status` would otherwise say "Unable to
    acquire lock" for as long as that fork lives. Nothing where DVC holds it otherwise (hardlink_lock)."""
    held = getattr(getattr(repo.lock, "_lock", None), "_fp", None)
    return kept_from_forks(held.fileno()) if held is not None else nullcontext()


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
