"""The twins fixture of the parity cases; the cases' machinery is in :mod:`twins` (a module of its
own: ``from conftest import`` finds whichever conftest pytest imported first)."""

from __future__ import annotations

import os

import pytest
from twins import Twins


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> Twins:
    """One git+DVC template per module, copied for each case (``dvc init`` costs a second)."""
    base = tmp_path_factory.mktemp("parity")
    env = {**os.environ, **prefect_server, "DVC_NO_ANALYTICS": "1", "COLUMNS": "200",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    made = Twins(base, env)
    template = base / "template"
    template.mkdir()
    for line in ("git init -q", "dvc init -q", "dvc config core.analytics false",
                 "printf '/.conveyor/\\n' > .gitignore", "git add -A", "git commit -qm init"):
        made.prepare(template, line)
    return made
