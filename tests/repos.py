"""New git + DVC repositories for the tests: ``git init -q && dvc init -q``, made once and copied.

``dvc init`` costs a start of DVC (0.7 CPU-seconds here), and many tests make a repository of
their own. :func:`git_dvc_init` runs the commands once per test process, in a
folder of its own, and copies what they made (``.git``, ``.dvc``, ``.dvcignore``) into each new
repository: none of it names its folder, so the copy is what the commands would have made
there, files staged in git's index as ``dvc init`` leaves them. DVC's scratch folder
(``.dvc/tmp``) is not copied: DVC makes it again when it needs it, as after a user removes it.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

INIT = (("git", "init", "-q"), ("dvc", "init", "-q"))
ANALYTICS_OFF = (*INIT, ("dvc", "config", "core.analytics", "false"))
_MADE: dict[tuple[tuple[str, ...], ...], Path] = {}


def git_dvc_init(root: Path, commands: tuple[tuple[str, ...], ...] = INIT) -> Path:
    """``root`` as ``commands`` (run in an empty folder) leave a new repository; returns ``root``."""
    template = _MADE.get(commands)
    if template is None:
        template = Path(tempfile.mkdtemp(prefix="conveyor-tests-repo-"))
        atexit.register(shutil.rmtree, template, True)
        for command in commands:
            subprocess.run(command, cwd=template, check=True, capture_output=True, timeout=120)
        _MADE[commands] = template
    root.mkdir(parents=True, exist_ok=True)
    for entry in template.iterdir():
        if entry.is_dir():
            scratch = shutil.ignore_patterns("tmp") if entry.name == ".dvc" else None
            shutil.copytree(entry, root / entry.name, symlinks=True, ignore=scratch)
        else:
            shutil.copy2(entry, root / entry.name)
    return root

