"""The docs' Get started pages, run as a reader runs them: every command of their ```bash blocks.

Each page runs in a fresh temporary directory (or, for a page that says
``<!-- doc test: in a fresh clone of this repository, after its first conveyor run -->``, in a
copy of the ``git clone`` of this repository that the README's first command ran in: the
session's :class:`projects.FirstRun`), its commands in order in one shell, so a ``cd`` carries on
to the next line, against the session's Prefect server; each must exit 0. Not run: ``pip install
...`` lines (CI installs the package itself, from the README's command), lines whose comment says
``(not run by the doc test: why)``, and a block that an HTML comment
``<!-- not run by the doc test: why -->`` right above it marks (a server in another terminal).
A line whose comment says ``(doc test: exit N)`` must exit N. A heredoc is one command.
own-project.md's commands are run by tests/cli/test_init.py, with more checks between them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from docpages import commands, script
from projects import REPO, FirstRun

GET_STARTED = REPO / "docs" / "getting-started"
# own-project.md's commands (`conveyor init myproj`, its first run, its own tests) are run by
# tests/cli/test_init.py, with more checks between them; it fails where the page's commands change
PAGES = ["first-run.md", "existing-dvc-yaml.md"]
IN_CLONE = "<!-- doc test: in a fresh clone of this repository, after its first conveyor run -->"


def _docs_module(name: str) -> ModuleType:
    """One of the docs' generators (docs/NAME.py), which are scripts, not a package."""
    found = importlib.util.spec_from_file_location(name, REPO / "docs" / f"{name}.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def test_every_key_of_the_spec_is_in_the_spec_reference() -> None:
    from conveyor.spec.schema import PROFILE_MODELS, spec_schema

    page = (REPO / "docs" / "reference" / "spec.md").read_text()
    defs = spec_schema()["$defs"]
    models = ["Pipeline", "Stage", "DvcPipeline", "Placement", "ModelSpec", "TlsFiles",
              *(model.__name__ for model in PROFILE_MODELS.values())]
    missing = [f"{m}.{key}" for m in models for key in defs[m]["properties"] if f"| `{key}` |" not in page]
    assert not missing, f"keys with no row in docs/reference/spec.md: {missing}"


def test_the_spec_key_tables_are_what_the_schema_generates() -> None:
    from conveyor.spec.schema import spec_schema

    generator = _docs_module("gen_spec_keys")
    page = (REPO / "docs" / "reference" / "spec.md").read_text()
    assert generator.block(spec_schema()) in page, "run: python docs/gen_spec_keys.py"


def test_the_cli_reference_has_every_command_help() -> None:
    text = _docs_module("gen_cli").cli_markdown()
    for command in ("conveyor", "conveyor run", "conveyor server stop", "conveyor serve-model"):
        assert f"$ {command} --help\nUsage: {command} " in text


def test_commands_are_found_and_installs_are_left_to_ci() -> None:
    page = (GET_STARTED / "own-project.md").read_text()
    texts = [c.text.split("#")[0].strip() for c in commands(page)]
    assert texts[:3] == ["conveyor init myproj", "cd myproj", "conveyor run"]
    assert not any(t.startswith("pip install") for t in texts)
    assert commands((GET_STARTED / "install.md").read_text()) == []  # two installs: CI runs them


@pytest.mark.slow
@pytest.mark.parametrize("name", PAGES)
def test_get_started_commands_run(name: str, tmp_path: Path, prefect_server: dict[str, str],
                                  request: pytest.FixtureRequest) -> None:
    page = (GET_STARTED / name).read_text()
    where = tmp_path / "fresh"
    if IN_CLONE in page:
        first: FirstRun = request.getfixturevalue("first_run")  # asked for only here: made once per test run
        first.copy(where, prefect_server)
    else:
        where.mkdir()
    steps = commands(page)
    env = {**os.environ, **prefect_server, "COLUMNS": "120", "GIT_AUTHOR_NAME": "doc test",
           "GIT_AUTHOR_EMAIL": "doc@example.com", "GIT_COMMITTER_NAME": "doc test",
           "GIT_COMMITTER_EMAIL": "doc@example.com"}
    done = subprocess.run(["bash", "-c", script(steps)], cwd=where, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
