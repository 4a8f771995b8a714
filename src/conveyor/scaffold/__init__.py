"""``conveyor init``: a new project that runs green at once.

The project is made from ``template/`` (a task stage, a cmd stage, params, a spec with a
threads and a dask profile, Prefect flows and prefect.yaml, tests), named after its
directory, with the spec's JSON Schema beside it for editors (the spec's first line names
it). Then git is initialised (unless the directory is inside a repository already), DVC
too (``--subdir`` inside one), and dvc.yaml is compiled from the spec, so that
``conveyor run``, ``dvc repro`` and ``python -m pytest`` all work in it at once.

It never replaces a file of the user's: DIR must be new or empty, and every file is
created exclusively, so one that appeared meanwhile stops init rather than being overwritten.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conveyor.errors import UsageError

TEMPLATE = Path(__file__).with_name("template")
PLACEHOLDER = "__project__"
RENAMED = {"gitignore": ".gitignore"}  # a dotfile would not travel in the wheel's package data


def project_name(folder: str) -> str:
    """A pipeline name from a directory name: letters, digits, ``_`` and ``-``, starting with a letter."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", folder).strip("-_")
    name = re.sub(r"^[^A-Za-z]+", "", name)
    return name or "project"


def init_project(target: Path) -> Made:
    """Make a project in ``target`` (new, or an empty directory): where, and what it did with git."""
    target = target.resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target} is not empty: conveyor init makes a project in a new or empty directory "
                         "(pass another DIR)")
    blocker = next((folder for folder in target.parents if folder.exists() and not folder.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"{blocker} is a file: conveyor init cannot make {target} inside it (pass another DIR)")
    if shutil.which("git") is None:
        raise UsageError("conveyor init needs git (DVC versions the project's data through it): install git")
    try:
        _copy_template(target, project_name(target.name))
        _write_schema(target)
    except FileExistsError as exc:  # made there while init ran
        raise UsageError(f"{exc.filename} appeared while conveyor init ran: it never replaces a file "
                         "(pass another DIR)") from exc
    repository = _git_toplevel(target)
    if repository is None:
        subprocess.run(["git", "init", "-q"], cwd=target, check=True)
    _init_dvc(target, subdir=repository is not None)
    _compile(target)
    if repository is not None:  # a subdir project of the user's repository: what to commit there is theirs
        return Made(target, "a DVC subdir project of the git repository around it; commit it when you are ready")
    why_not = _first_commit(target)
    return Made(target, "git and DVC initialised, first commit made" if why_not is None else
                f"git and DVC initialised; no first commit: {why_not}, then git commit")


@dataclass(frozen=True)
class Made:
    """The project ``conveyor init`` made, and what it did with git, in words."""

    root: Path
    git: str


def _first_commit(root: Path) -> str | None:
    """Commit everything ``conveyor init`` made, as the project's first commit; None when done, else
    why not (git without user.name/user.email: the user's to set, never set for them)."""
    subprocess.run(["git", "add", "-A"], cwd=root, check=True, capture_output=True)
    done = subprocess.run(["git", "commit", "-q", "-m", "conveyor init: a new project"], cwd=root,
                          capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip().splitlines()
    if any("user.email" in line or "user.name" in line or "identity" in line for line in said):
        return "git has no user.name and user.email here (git config --global user.name/user.email)"
    return said[-1] if said else f"git commit exited {done.returncode}"


def _copy_template(target: Path, name: str) -> None:
    for source in sorted(TEMPLATE.rglob("*")):
        rel = source.relative_to(TEMPLATE)
        if "__pycache__" in rel.parts or source.is_dir():
            continue
        path = target / rel.parent / RENAMED.get(rel.name, rel.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("x", encoding="utf-8") as fh:  # "x": never over a file that is there
            fh.write(source.read_text(encoding="utf-8").replace(PLACEHOLDER, name))


def _write_schema(target: Path) -> None:
    """The spec's JSON Schema, where the template spec's ``$schema`` line points: a file, so that
    an editor checks the spec offline and against the installed conveyor's models."""
    from conveyor.spec.schema import SCHEMA_FILE, schema_text

    with (target / SCHEMA_FILE).open("x", encoding="utf-8") as fh:
        fh.write(schema_text())


def _git_toplevel(folder: Path) -> Path | None:
    done = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder, capture_output=True, text=True,
                          check=False)
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def _init_dvc(root: Path, *, subdir: bool) -> None:
    import logging

    from dvc.repo import Repo

    dvc_log = logging.getLogger("dvc")
    level = dvc_log.level
    dvc_log.setLevel(logging.WARNING)  # its "Initialized DVC repository" lines: conveyor says what it made
    try:
        Repo.init(str(root), subdir=subdir).close()
    finally:
        dvc_log.setLevel(level)


def _compile(root: Path) -> None:
    from conveyor.dvc.compile import write_dvc_yaml
    from conveyor.spec.project import DEFAULT_SPEC, load_project

    write_dvc_yaml(load_project(root / DEFAULT_SPEC))
