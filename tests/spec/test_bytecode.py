"""Python's cached bytecode of an earlier version of a source, in the same second and size, is dropped."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

from conveyor.spec.bytecode import drop_doubtful

V1 = "VALUE = 'v1'\n"
V2 = "VALUE = 'v2'\n"  # the same size


def _at(path: Path, second: int, fraction: float) -> None:
    ns = second * 1_000_000_000 + int(fraction * 1_000_000_000)
    os.utime(path, ns=(ns, ns))


def _imported(folder: Path) -> str:
    """``mod.VALUE`` as a fresh Python imports it from ``folder`` (its pyc, where Python trusts it)."""
    done = subprocess.run([sys.executable, "-c", "import mod; print(mod.VALUE)"], cwd=folder,
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(folder)})
    return done.stdout.strip()


def _edited_in_the_second_compiled(tmp_path: Path, pyc_written_after_s: float) -> tuple[Path, Path]:
    """mod.py compiled at v1, then made v2 within the same second: the pyc written that long after the
    second began."""
    source = tmp_path / "mod.py"
    second = int(time.time()) - 100
    source.write_text(V1)
    _at(source, second, 0.1)
    cached = Path(importlib.util.cache_from_source(str(source)))
    py_compile.compile(str(source), cfile=str(cached), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    _at(cached, second, pyc_written_after_s)
    source.write_text(V2)
    _at(source, second, 0.7)
    return source, cached


def test_a_pyc_of_an_earlier_version_in_the_same_second_and_size_is_dropped(tmp_path: Path) -> None:
    source, cached = _edited_in_the_second_compiled(tmp_path, 0.4)
    assert _imported(tmp_path) == "v1"  # Python's own check: the old code runs
    source, cached = _edited_in_the_second_compiled(tmp_path, 0.4)
    assert drop_doubtful([source]) == [cached]
    assert not cached.exists()
    assert _imported(tmp_path) == "v2"
    assert drop_doubtful([source]) == []  # the new pyc, written now, is of the source as it is
    assert cached.exists()


def test_a_pyc_older_than_a_source_written_with_its_mtime_put_back_is_dropped(tmp_path: Path) -> None:
    """``tar x``, ``cp -p``, ``rsync -t``: new bytes, the second and size the pyc recorded."""
    source, cached = _edited_in_the_second_compiled(tmp_path, 50)  # v1 compiled long after its second,
    # then v2 written (now) with an mtime in that second
    assert _imported(tmp_path) == "v1"  # Python's own check: the pyc of v1 runs for v2
    assert drop_doubtful([source]) == [cached]
    assert _imported(tmp_path) == "v2"


def test_another_pythons_pyc_beside_it_is_dropped_too(tmp_path: Path) -> None:
    """A command's ``python3.12 scripts/x.py`` reads its own cache file of the module."""
    source, cached = _edited_in_the_second_compiled(tmp_path, 0.4)
    other = cached.with_name("mod.cpython-312.pyc")
    cached.rename(other)
    assert drop_doubtful([source]) == [other]


def test_pycs_python_checks_itself_or_written_after_the_second_are_kept(tmp_path: Path) -> None:
    source, cached = _edited_in_the_second_compiled(tmp_path, 0.4)
    now = time.time_ns() + 1_000_000_000
    os.utime(cached, ns=(now, now))  # written well after the second, and after the source: of v2 in truth
    assert drop_doubtful([source]) == []

    second = int(source.stat().st_mtime)
    source.write_text("VALUE = 'v22'\n")  # another size: Python compiles again by itself
    _at(source, second, 0.8)
    assert drop_doubtful([source]) == []

    py_compile.compile(str(source), cfile=str(cached), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert drop_doubtful([source]) == []  # hash-based: Python compares the source's hash
    assert drop_doubtful([tmp_path / "missing.py", tmp_path / "data.csv"]) == []


def test_installed_packages_are_left_alone(tmp_path: Path) -> None:
    """pip writes a package's sources and compiles them in the same second: not an edit."""
    installed = tmp_path / "lib/site-packages"
    installed.mkdir(parents=True)
    source, cached = _edited_in_the_second_compiled(installed, 0.4)
    assert drop_doubtful([source]) == []
    assert cached.exists()
