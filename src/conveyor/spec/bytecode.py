"""Python's cached bytecode of a stage's code that may be of an earlier version of it: dropped before
the stage imports its code.

Python trusts a module's ``__pycache__/*.pyc`` while its source keeps the modification time, in
whole seconds, and the size the pyc recorded (PEP 552's timestamp pycs, the default). An edit that
keeps the size, within the second of the version Python compiled (``lr = 0.1`` made ``lr = 0.2``
by a script, or by hand, just after a run imported the module: a warm runner's runs take well
under a second), leaves the old bytecode in use. The stage would run the old code while its record
names the new file's hash (DVC's run cache then restores those outs for the new code), and so
would every later run, the file unchanged.

A pyc can be of another version of a source that has its recorded second and size only if it was
written within that second, or just after it (the compile that read the source then took that
long), or if the source was written after it with its old mtime put back (``tar x``, ``cp -p``,
``rsync -t``: its ctime says so): those are removed, and Python compiles the source again as the
stage imports it (and caches the new bytecode). Any other pyc is of the source as it is, as is a
hash-based one (Python compares the source's hash). Every Python's pyc of the file is looked at (a command may run
another version), each one ``stat`` and 16 bytes read. Installed packages are left alone: their
installer compiled them as it wrote them, which only looks like this.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

COMPILE_S = 2  # the longest a compile that read the source takes to write its pyc


def drop_doubtful(sources: Iterable[Path]) -> list[Path]:
    """Remove the pycs of ``sources`` that a Python would take for the source as it is, but may be of
    an earlier version of it (this Python's, and other versions' beside them: a command's ``python3.12``);
    return them."""
    dropped = []
    listed: dict[Path, list[str]] = {}  # each __pycache__ folder read once
    for source in sources:
        if source.suffix != ".py" or {"site-packages", "dist-packages"} & set(source.parts):
            continue  # not Python, or installed (a task of an installed package): compiled once by its installer
        try:
            st = os.stat(source)
        except OSError:
            continue
        for cached in _caches(source, listed):
            if _doubtful(cached, st):
                with contextlib.suppress(OSError):  # gone already, or a read-only project (whose code does not change)
                    os.unlink(cached)
                    dropped.append(cached)
    return dropped


def _caches(source: Path, listed: dict[Path, list[str]]) -> list[Path]:
    """``source``'s pycs: this Python's (``PYTHONPYCACHEPREFIX`` heeded), and any other's in ``__pycache__``."""
    folder = source.parent / "__pycache__"
    if folder not in listed:
        try:
            listed[folder] = sorted(os.listdir(folder))
        except OSError:
            listed[folder] = []
    found = [folder / name for name in listed[folder] if name.startswith(f"{source.stem}.") and name.endswith(".pyc")]
    with contextlib.suppress(NotImplementedError, ValueError):
        mine = Path(importlib.util.cache_from_source(str(source)))
        found = [mine, *(path for path in found if path != mine)]
    return found


def _doubtful(cached: Path, st: os.stat_result) -> bool:
    try:
        with open(cached, "rb") as f:
            header, written = f.read(16), os.fstat(f.fileno()).st_mtime_ns
    except OSError:
        return False  # no pyc: nothing a Python would trust
    if len(header) < 16 or int.from_bytes(header[4:8], "little") & 0b1:
        return False  # too short to be used, or hash-based
    second = int(st.st_mtime)
    if header[8:12] != (second & 0xFFFFFFFF).to_bytes(4, "little") or \
            header[12:16] != (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"):
        return False  # a Python sees the change itself
    if written < (second + 1 + COMPILE_S) * 1_000_000_000:
        return True  # written in the second of a version, or just after: of which one?
    return st.st_ctime_ns > written  # the file written or replaced since, its mtime put back (tar, cp -p, rsync -t)
