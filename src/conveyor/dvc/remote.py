"""Data by hash through the project's DVC remote, for workers that do not see the project's disk.

Both sides use DVC's own code (``dvc_data``): files and directories are hashed as ``dvc add``
hashes them (md5; a directory is a ``.dir`` object listing its files), stored in the remote's
object layout (``files/md5/xx/yyyy``) and checked out from it, so what a worker sends back is
what ``dvc push`` would have sent and ``dvc pull`` brings back. The runner opens the remote from
the repository's config (:func:`default_remote`); a worker, which has no repository, opens it
from the :class:`RemoteStore` it was sent (the filesystem's class, its options, the path).
DVC is imported lazily, inside the functions.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import RemoteDataError

if TYPE_CHECKING:
    from dvc_data.hashfile.db import HashFileDB


@dataclass(frozen=True)
class RemoteStore:
    """A DVC remote as a process without the repository opens it (it pickles: it travels to workers).

    ``options`` are the filesystem's, as DVC's config gives them (credentials included, when the
    config holds them: they travel to the workers as the rest of the stage does)."""

    name: str
    url: str  # as the user configured it, for messages
    fs_class: type
    path: str  # the remote's root on that filesystem
    options: Mapping[str, Any] = field(default_factory=dict)
    # how a worker puts a dep into its scratch directory: the project's ``cache.type``, as DVC links
    # its cache into a workspace (default: a reflink where the filesystem can, else a copy)
    links: tuple[str, ...] = ()

    def odb(self, state: Any = None) -> HashFileDB:
        """The remote's object store (DVC 3's layout: ``files/md5`` under the root); ``state``: DVC's
        cache of the hashes of local files (a repository's ``repo.state``), None for none."""
        from dvc_data.hashfile.db import get_odb

        fs = self.fs_class(**self.options)
        known = {"state": state} if state is not None else {}
        odb: HashFileDB = get_odb(fs, fs.join(self.path, "files", "md5"), hash_name="md5",  # type: ignore[no-untyped-call]
                                  **known)
        return odb


def default_remote(root: Path) -> RemoteStore | None:
    """The DVC repository's default remote at ``root`` (None: not a DVC repository, or no default)."""
    if not (root / ".dvc").is_dir():
        return None
    from dvc.config import Config
    from dvc.fs import get_cloud_fs

    config = Config(dvc_dir=str(root / ".dvc"))
    name = config["core"].get("remote")
    if not name:
        return None
    fs_class, options, path = get_cloud_fs(config, name=name)
    return RemoteStore(name=name, url=str(config["remote"][name].get("url", path)), fs_class=fs_class,
                       path=path, options=dict(options), links=tuple(config["cache"].get("type") or ()))


def push(store: RemoteStore, root: Path, rels: Iterable[str], state: Any = None) -> dict[str, str]:
    """Hash each path under ``root`` (file or directory) and store what the remote lacks; returns
    each path's hash (DVC's value: a directory's ends in ``.dir``). A missing path is left out.
    ``state``: DVC's cache of file hashes, so that a file DVC hashed already is not read again."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.transfer import transfer
    from dvc_objects.fs.local import LocalFileSystem

    odb, fs = store.odb(state), LocalFileSystem()  # type: ignore[no-untyped-call]
    hashes: dict[str, str] = {}
    for rel in rels:
        path = root / rel
        if not path.exists():
            continue
        with _reaching(store, f"storing {rel} in"):
            staging, _meta, obj = build(odb, str(path), fs, "md5")
            transfer(staging, odb, {obj.hash_info}, shallow=False, hardlink=False)
        hashes[rel] = str(obj.hash_info.value)
    return hashes


def materialise(store: RemoteStore, root: Path, hashes: Mapping[str, str], *, linked: bool = False) -> None:
    """Check each path out of the remote under ``root`` by its hash (only these paths; written
    beside the target, then renamed into place, so a path is whole or absent). ``linked``: as the
    project's ``cache.type`` says (a hardlink to the remote's read-only object, where the user chose
    it for the cache), for a scratch directory's deps; else copies (reflinks where possible)."""
    from dvc_data.hashfile import load
    from dvc_data.hashfile.checkout import checkout
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_objects.fs.local import LocalFileSystem

    odb, fs = store.odb(), LocalFileSystem()  # type: ignore[no-untyped-call]
    if linked and store.links:  # a copy last: a link across filesystems fails
        odb.cache_types = list(dict.fromkeys([*store.links, "copy"]))
    for rel, value in hashes.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        draft = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.fetching")
        try:
            with _reaching(store, f"checking {rel} out of"):
                obj = load(odb, HashInfo("md5", value))
                checkout(str(draft), fs, obj, cache=odb, quiet=True)
            _replace(draft, target)
        finally:
            _remove(draft)


@contextmanager
def _reaching(store: RemoteStore, doing: str) -> Iterator[None]:
    """DVC's errors on the way to or from the remote, as one that says what to configure."""
    from dvc_data.hashfile.checkout import CheckoutError

    try:
        yield
    except (OSError, CheckoutError) as exc:
        raise RemoteDataError(store.name, store.url, doing, f"{type(exc).__name__}: {exc}") from exc


def _replace(draft: Path, target: Path) -> None:
    """``draft`` in place of ``target`` (a directory replaced whole)."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    os.replace(draft, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
