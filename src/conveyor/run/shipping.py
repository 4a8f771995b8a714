"""The project's code travels with the run to Dask workers and schedulers that do not have it.

A task sends the workers functions of the project (``client.submit(tasks.fit.one_fold, ...)``,
``ddf.map_partitions(tasks.clean.rows)``, a DDP rank's body). Dask pickles them by reference
(module and name), so the scheduler, which unpickles the task graph, and every worker had to
import the project's package: installed on each node, reinstalled at every edit, and on a
cluster shared by two projects, a second project's ``tasks`` found the first one's.

conveyor pickles the project's modules by value instead (cloudpickle's ``register_pickle_by_value``):
the code of the functions and classes, as they are in the runner at this run, goes in the
payload; nothing is installed on the nodes and nothing stays there (no module enters a worker's
``sys.modules``). Dask decides between the standard pickle and cloudpickle per payload
(``distributed.protocol.pickle.dumps``: cloudpickle when the pickle names ``__main__``); conveyor
adds "names a module of the project" to that rule by wrapping the function, so the graph a
task builds with project functions anywhere inside it is pickled by value too. A module of the
project is one whose file lies under a project directory on ``sys.path`` (the root, ``src/``),
outside any ``site-packages``; conveyor itself is never one (the nodes must have it).
"""

from __future__ import annotations

import pickle
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_roots: set[Path] = set()  # the project roots whose modules travel by value (one per process, in practice)
_names: set[str] = set()  # their top-level module names, found on sys.path under those roots
_registered: set[str] = set()


def ship_project_code(root: Path) -> None:
    """From now on in this process, the project's modules under ``root`` are pickled by value
    whenever Dask sends something that names them (idempotent, thread-safe)."""
    with _lock:
        if root not in _roots:
            _roots.add(root)
            _names.update(_top_level_names(root))
        _install()


def project_names() -> frozenset[str]:
    """The top-level module names that travel by value (for tests and messages)."""
    with _lock:
        return frozenset(_names)


def _top_level_names(root: Path) -> set[str]:
    """Modules and packages directly in the entries of ``sys.path`` that lie in ``root``."""
    names: set[str] = set()
    resolved = root.resolve()
    for entry in sys.path:
        try:
            where = Path(entry or ".").resolve()
        except OSError:
            continue
        if not where.is_relative_to(resolved) or {"site-packages", "dist-packages"} & set(where.parts):
            continue
        for child in _children(where):
            if child.suffix == ".py":
                names.add(child.stem)
            elif (child / "__init__.py").is_file():
                names.add(child.name)
    names.discard("conveyor")
    return {name for name in names if name.isidentifier()}


def _children(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _register_imported() -> None:
    """Register by value the project's modules imported so far (cloudpickle wants the module)."""
    import cloudpickle

    for name in _names - _registered:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)
            _registered.add(name)


def _names_project(payload: bytes) -> bool:
    """Whether a standard pickle refers to a module of the project: a short string of the pickle
    (opcode SHORT_BINUNICODE, its length, its bytes) that is one of the names or starts with one
    and a dot, as a global's module is written from protocol 4 on (protocol 3 and below: any
    mention; a false alarm only costs cloudpickle's slower path)."""
    pattern = _pattern()
    if pattern is None:
        return False
    for found in pattern.finditer(payload):
        if found.group(1)[0] == len(found.group(0)) - 2:
            return True
    return any(name.encode() in payload for name in _names) if payload[1:2] < b"\x04" else False


_compiled: tuple[frozenset[str], re.Pattern[bytes] | None] = (frozenset(), None)


def _pattern() -> re.Pattern[bytes] | None:
    global _compiled
    names = frozenset(_names)
    if names != _compiled[0]:
        alternatives = b"|".join(re.escape(name.encode()) for name in sorted(names, key=len, reverse=True))
        _compiled = (names, re.compile(rb"\x8c([\x00-\xff])(?:" + alternatives + rb")(?:\.[\w.]+)?") if names else None)
    return _compiled[1]


def _install() -> None:
    """Wrap Dask's ``dumps`` once, where the protocol and the client look it up."""
    import distributed.client
    import distributed.protocol.pickle as dask_pickle

    if getattr(dask_pickle.dumps, "conveyor_ships", False):
        return
    wrapped = _shipping(dask_pickle.dumps)
    dask_pickle.dumps = wrapped
    if getattr(distributed.client, "dumps", None) is not None:  # bound by name there
        setattr(distributed.client, "dumps", wrapped)  # noqa: B010 - not an exported attribute


def _shipping(dumps: Callable[..., bytes]) -> Callable[..., bytes]:
    def shipping_dumps(x: Any, *, buffer_callback: Callable[[Any], None] | None = None,
                       protocol: int | None = pickle.HIGHEST_PROTOCOL) -> bytes:
        buffers: list[Any] = []
        collect = buffers.append if buffer_callback is not None else None
        result = dumps(x, buffer_callback=collect, protocol=protocol)
        if _names and _names_project(result):
            import cloudpickle

            with _lock:
                _register_imported()
            by_reference = list(buffers)
            buffers.clear()
            kwargs: dict[str, Any] = {"protocol": protocol or pickle.HIGHEST_PROTOCOL}
            if collect is not None and kwargs["protocol"] >= 5:
                kwargs["buffer_callback"] = collect
            try:
                result = cloudpickle.dumps(x, **kwargs)
            except (pickle.PicklingError, TypeError, AttributeError):  # by value, a global of the code does not
                # pickle (a lock, a connection):
                buffers[:] = by_reference  # as Dask sent it, by reference (workers that have the project run it)
        if buffer_callback is not None:
            for buffer in buffers:
                buffer_callback(buffer)
        return result

    shipping_dumps.conveyor_ships = True  # type: ignore[attr-defined]
    return shipping_dumps

