"""A restore that lies: a DVC cache object damaged on disk (bit rot: same size, mtime and mode kept).

DVC trusts a read-only cache object without reading it, and its run cache checks the damaged
bytes out as the stage's recorded out; after that ``dvc status`` is clean. conveyor hashes what
a restore brought back: on a mismatch the stage runs for real, the damaged object is moved
aside (so that no later restore or commit picks it), and the user is told which one it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from projects import Project

pytestmark = pytest.mark.slow

DVC_YAML = """
stages:
  build:
    cmd: python write.py ${n}
    params: [n]
    outs: [out.txt, parts]
"""

WRITE = """
import sys
from pathlib import Path

n = int(sys.argv[1])
Path("out.txt").write_text("".join(f"line {i} of run {n}\\n" for i in range(200)))
Path("parts").mkdir(exist_ok=True)
for k in range(2):
    Path(f"parts/{k}.txt").write_text(f"part {k} of run {n}\\n" * 50)
with open("ran.log", "a") as fh:  # not an out: how many times the command really ran
    fh.write(f"{n}\\n")
"""



def _dvc_project(make_project: Callable[[], Project]) -> Project:
    """A plain DVC project (no conveyor spec): git, DVC, the one-stage dvc.yaml above, n = 1."""
    project = make_project()
    (project.root / "pyproject.toml").unlink()
    project.write("dvc.yaml", DVC_YAML)
    project.write("write.py", WRITE)
    project.write("params.yaml", "n: 1\n")
    project.init_dvc()
    return project


def _run(project: Project) -> subprocess.CompletedProcess[str]:
    done = project.conveyor("run")
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _object(project: Project, data: bytes) -> Path:
    """Where DVC's cache keeps the object with these bytes."""
    md5 = hashlib.md5(data).hexdigest()  # DVC's object names
    return project.root / ".dvc/cache/files/md5" / md5[:2] / md5[2:]


def _rot(path: Path) -> None:
    """Flip a few bytes in place, as bit rot does: size, mtime and read-only mode as they were."""
    before = path.stat()
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    for i in (3, len(data) // 2):
        data[i] ^= 0x20
    path.write_bytes(bytes(data))
    path.chmod(before.st_mode & 0o777)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_damaged_cache_object_is_not_restored_the_stage_runs_and_the_user_is_told_which(
        make_project: Callable[[], Project]) -> None:
    project = _dvc_project(make_project)
    _run(project)
    first = {rel: (project.root / rel).read_bytes() for rel in ("out.txt", "parts/0.txt", "parts/1.txt")}
    project.write("params.yaml", "n: 2\n")
    _run(project)
    project.write("params.yaml", "n: 1\n")  # back: DVC's run cache holds the first result
    _run(project)
    assert (project.root / "ran.log").read_text() == "1\n2\n", "the run cache did not stand in for the run"
    assert "restored from DVC's run cache" in project.record()["stages"]["build"]["reason"]

    damaged = [_object(project, first["out.txt"]), _object(project, first["parts/1.txt"])]
    for path in damaged:
        _rot(path)
    project.write("params.yaml", "n: 2\n")
    _run(project)
    project.write("params.yaml", "n: 1\n")
    done = _run(project)

    assert (project.root / "ran.log").read_text() == "1\n2\n1\n", "the damaged objects were restored"
    for rel, data in first.items():
        assert (project.root / rel).read_bytes() == data, rel
    named = [line for line in done.stderr.splitlines() if "damaged" in line]
    for path in damaged:
        rel = path.relative_to(project.root).as_posix()
        assert any(rel in line for line in named), done.stderr
        assert path.read_bytes() == first["out.txt" if path == damaged[0] else "parts/1.txt"]  # stored again
    moved = project.root / ".dvc/cache/damaged/files/md5"
    assert sorted(p.name for p in moved.rglob("*") if p.is_file()) == sorted(p.name for p in damaged)
    assert "Traceback" not in done.stdout + done.stderr
    reason = project.record()["stages"]["build"]["reason"]
    assert "damaged" in reason and "restored from DVC's run cache" not in reason, reason
    assert json.loads(project.sh("dvc", "status", "--json").stdout) == {}


def test_an_out_checked_out_again_from_dvc_lock_is_checked_too(make_project: Callable[[], Project]) -> None:
    """The other restore: the stage is as dvc.lock records it but an out was deleted, so DVC
    checks dvc.lock's outs out of its cache (no run cache entry needed)."""
    project = _dvc_project(make_project)
    _run(project)
    data = (project.root / "out.txt").read_bytes()
    (project.root / "out.txt").unlink()
    _rot(_object(project, data))
    done = _run(project)

    assert (project.root / "ran.log").read_text() == "1\n1\n", "the damaged object was restored"
    assert (project.root / "out.txt").read_bytes() == data
    assert _object(project, data).read_bytes() == data
    assert _object(project, data).relative_to(project.root).as_posix() in done.stderr
    assert json.loads(project.sh("dvc", "status", "--json").stdout) == {}
