"""Twin projects: the same files in two git+DVC repositories, one run by ``dvc repro ARGS``, the
other by ``conveyor run ARGS``, then compared as a DVC user would compare them.

A case (:class:`Case`) names the DVC test it comes from, the files, what is done in the repository
before the twins part (``dvc add``, a first ``dvc repro``, a commit), what is done to both after
(a file changed), and the arguments. :func:`run_twins` runs both tools and checks that they agree
on success, on the stages that ran, on every byte of the workspace (dvc.lock and ``.dvc`` files
parsed), on the DVC cache's objects, and, when both succeeded, that ``dvc status`` says of
conveyor's copy what it says after ``dvc repro`` (nothing, but for a frozen callback stage) and
a following ``dvc repro`` runs nothing (but the stages it always runs: without deps or outs).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from repos import dvc_here

# not compared byte for byte: conveyor's own state, DVC's scratch, git, and the cache (its objects are)
SKIPPED = (".conveyor", ".git", ".dvc/tmp", ".dvc/cache")


@dataclass(frozen=True)
class Case:
    """One scenario: ``files`` written and ``setup`` run (shell lines) in one repository, which is
    then copied; ``then`` runs in both copies; ``args`` go to ``dvc repro`` and ``conveyor run``."""

    id: str  # the DVC test it mirrors: tests/func/repro/test_repro.py::test_...
    files: Mapping[str, str]
    args: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    then: tuple[str, ...] = ()
    succeeds: bool = True  # what dvc repro is expected to do: the case pins the reference too
    conveyor_args: tuple[str, ...] | None = None  # where conveyor spells a flag differently
    says: str | None = None  # a pattern conveyor's output must hold (its refusal, in DVC's words)
    one_line: bool = False  # and that output is that one line
    # outs a failed stage had before, which dvc repro deletes before the command (then fails) and
    # conveyor keeps (README, Failure handling: a failed stage's previous outs stay in place)
    kept: tuple[str, ...] = ()
    # what a failed command wrote where its stage had no outs before: dvc repro leaves it, conveyor
    # puts back what was there (nothing)
    dropped: tuple[str, ...] = ()
    # .gitignore lines for the outs of stages that succeeded in a failed run: dvc repro takes them
    # back (its scm context undoes every ignore of a command that fails; the outs stay in dvc.lock,
    # untracked by git), conveyor keeps them
    ignored: tuple[str, ...] = ()


@dataclass
class Outcome:
    """What one tool did to its copy."""

    root: Path
    returncode: int
    output: str
    ran: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Twins:
    """Where twin repositories are made, and the environment both tools run in."""

    base: Path
    env: Mapping[str, str]

    def sh(self, root: Path, line: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(line, shell=True, cwd=root, env=dict(self.env), capture_output=True, text=True,
                              timeout=300)
        if check:
            assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
        return done

    def repro(self, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """``dvc repro ARGS`` (words as a shell splits them) through DVC's command line in this process,
        as DVC's own tests run it (:func:`dvc_here`): what its commands print is not in the result."""
        return dvc_here(root, ["repro", *shlex.split(" ".join(args))], self.env)

    def prepare(self, root: Path, line: str) -> None:
        """A line that sets a case up: a plain ``dvc`` command through DVC's command line in this
        process (:func:`dvc_here`), anything else in a shell; it must succeed."""
        if line.startswith("dvc ") and not _SHELL.search(line):
            done = dvc_here(root, line.split()[1:], self.env)
            assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
        else:
            self.sh(root, line)

    def make(self, case: Case) -> tuple[Path, Path]:
        """Two repositories with the case's files and setup: (for dvc, for conveyor)."""
        root = self.base / f"{re.sub(r'[^A-Za-z0-9]+', '-', case.id)[-60:]}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(self.base / "template", root, symlinks=True)
        for rel, text in case.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        for line in case.setup:
            self.prepare(root, line)
        twin = root.with_name(root.name + "-conveyor")
        shutil.copytree(root, twin, symlinks=True, ignore=shutil.ignore_patterns("tmp"))
        for where in (root, twin):
            for line in case.then:
                self.prepare(where, line)
        return root, twin


# what a shell would read otherwise than as words: such a line runs in a shell
_SHELL = re.compile(r"[|&;<>()$`*?\[\]{}~'\"\\]")


def ran_by_dvc(output: str) -> set[str]:
    """Stages ``dvc repro`` started (run, failed or not), checked out of the run cache, or verified (frozen)."""
    found = set(re.findall(r"Running stage '([^']+)'", output))
    found |= set(re.findall(r"Stage '([^']+)' is cached - skipping run", output))
    found |= set(re.findall(r"Verifying outputs in frozen stage: '([^']+)'", output))
    return {name.removeprefix("dvc.yaml:") for name in found}  # another dvc.yaml's stage: sub/dvc.yaml:make


def ran_by_conveyor(root: Path) -> set[str]:
    """Stages whose command conveyor started (or whose outs it restored or verified)."""
    try:
        record = json.loads((root / ".conveyor/runs/latest.json").read_text())
    except FileNotFoundError:
        return set()
    return {name for name, st in record["stages"].items() if st["status"] in ("succeeded", "failed")}


def workspace(root: Path) -> dict[str, Any]:
    """Every file but the skipped folders: bytes, or the parsed YAML of dvc.lock and ``.dvc`` files,
    and .gitignore as a set of lines (DVC appends a line per out in the order stages finish)."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() or any(rel == s or rel.startswith(s + "/") for s in SKIPPED):
            continue
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.name == "dvc.lock" or path.suffix == ".dvc":
            found[rel] = yaml.safe_load(path.read_text())
        elif path.name == ".gitignore":
            found[rel] = sorted(path.read_text().splitlines())
        else:
            found[rel] = path.read_bytes()
    return found


def cache_objects(root: Path) -> set[str]:
    """The cache's objects and its run cache's entries (named by the hashes of what ran)."""
    cache = root / ".dvc/cache"
    return {p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()}


def dvc_status(twins: Twins, root: Path) -> dict[str, Any]:
    """What ``dvc status`` says of a copy: ``{}`` when clean."""
    done = dvc_here(root, ["status", "--json"], twins.env)
    assert done.returncode == 0, done.stdout + done.stderr
    found: dict[str, Any] = json.loads(done.stdout)  # "{}" when clean: never empty
    return found


def run_twins(twins: Twins, case: Case) -> tuple[Outcome, Outcome]:
    """Run the case under both tools and assert that they agree; returns (dvc's, conveyor's)."""
    theirs, ours = twins.make(case)
    repro = twins.repro(theirs, *case.args)
    dvc = Outcome(theirs, repro.returncode, repro.stdout + repro.stderr, ran_by_dvc(repro.stdout))
    assert (dvc.returncode == 0) == case.succeeds, f"dvc repro did not do what the case says:\n{dvc.output}"
    args = case.args if case.conveyor_args is None else case.conveyor_args
    run = twins.sh(ours, " ".join(["conveyor", "run", *args]), check=False)
    conveyor = Outcome(ours, run.returncode, run.stdout + run.stderr, ran_by_conveyor(ours))
    said = f"\n--- dvc repro:\n{dvc.output}\n--- conveyor run:\n{conveyor.output}"
    assert (conveyor.returncode == 0) == (dvc.returncode == 0), said
    assert "Traceback" not in conveyor.output, said
    if case.says is not None:
        assert re.search(case.says, conveyor.output, re.MULTILINE), said
        assert not case.one_line or len(conveyor.output.strip().splitlines()) == 1, said
    assert conveyor.ran == dvc.ran, said
    mine, reference = workspace(ours), workspace(theirs)
    assert all(mine.pop(path, None) is not None for path in case.kept), said
    assert all(reference.pop(path, None) is not None for path in case.dropped), said
    if case.ignored:
        assert set(case.ignored) <= set(mine[".gitignore"]), said
        mine[".gitignore"] = sorted(set(mine[".gitignore"]) - set(case.ignored))
    assert mine == reference, said
    assert cache_objects(ours) == cache_objects(theirs), said
    if dvc.returncode == 0:  # clean, as after dvc repro (a frozen callback stage is "always changed" to both)
        status = dvc_status(twins, ours)
        if status:  # when clean, `dvc repro` has nothing to run: every stage it would run shows in the status
            assert status == dvc_status(twins, theirs), f"{status}{said}"
            again = ran_by_dvc(twins.repro(ours).stdout)  # nothing, but stages always changed
            assert not again or again == ran_by_dvc(twins.repro(theirs).stdout), again
    return dvc, conveyor
