"""Remote files through fsspec: list what a URL names, stream a file, read a byte range.

One URL of ``ingest.sources`` (``file://``, ``http(s)://``, ``s3://``, any fsspec
protocol; globs allowed) becomes :class:`RemoteFile` entries, each with what the source
says about it: its size (Content-Length, S3 ``Size``) and, where one exists, an md5 to
check the bytes against (``md5:`` in params; the ETag of a single-part S3 object; an
HTTP ``Content-MD5``). Storage options come from params, keyed by protocol, so one
ingest can read from several stores. Retries are the caller's business (:mod:`conveyor.ingest.retry`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.resources
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.ingest.retry import Cancelled, TransferIncomplete

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

CHUNK_BYTES = 4 << 20  # read size of a streamed transfer: large enough, small enough to cancel
_PACKAGE_TEMPLATE = re.compile(r"\{package:([A-Za-z_][\w.]*)\}")
_GLOB_CHARS = ("*", "?", "[")
_URL_GLOB_CHARS = ("*", "[")  # in an http(s) URL, "?" starts the query (a signed URL's, say)
_MD5 = re.compile(r"[0-9a-f]{32}")
_SIZE_FROM_THE_ANSWER = -1  # a size fsspec takes as given (not 0 or None), so it sends no HEAD


@dataclass(frozen=True)
class Access:
    """How to reach a store: fsspec storage options per protocol, and the I/O timeout."""

    storage_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    timeout_s: float | None = 60.0
    verify_etag: bool = True

    def options(self, protocol: str) -> dict[str, Any]:
        """Storage options for ``protocol``; ``https`` falls back to ``http``'s."""
        chosen = self.storage_options.get(protocol)
        if chosen is None and protocol == "https":
            chosen = self.storage_options.get("http")
        return _with_timeout(protocol, dict(chosen or {}), self.timeout_s)


@dataclass(frozen=True)
class RemoteFile:
    """One file a source names, and what the source says about it."""

    url: str  # the source as written in params (a glob, maybe): what error messages name
    fs: AbstractFileSystem
    path: str
    size: int | None
    md5: str | None  # expected md5 (hex), if the source gives one
    md5_from: str = ""  # where the md5 came from: params, ETag, Content-MD5

    @property
    def location(self) -> str:
        """This file's own URL (for a glob source, the match)."""
        return str(self.fs.unstrip_protocol(self.path))


def expand_template(url: str) -> str:
    """Replace ``{package:NAME}`` with the directory of the installed package NAME."""
    return _PACKAGE_TEMPLATE.sub(lambda m: str(importlib.resources.files(m.group(1))), url)


def protocol_of(url: str) -> str:
    """``s3`` for ``s3://b/k``; ``file`` for a plain path."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def list_files(url: str, access: Access, *, md5: str | None = None, sized: bool = True) -> list[RemoteFile]:
    """The files ``url`` names: itself, or the sorted matches of a glob; raises
    FileNotFoundError when a glob matches nothing.

    ``sized=False``: the caller streams the file whole (:func:`download`) and needs no size up
    front; one http(s) URL is then not asked for it (a HEAD request, one round trip to the
    server per source): :func:`download` takes its size and Content-MD5 from the GET's answer.
    """
    import fsspec.core

    protocol = protocol_of(url)
    fs, path = fsspec.core.url_to_fs(expand_template(url), **access.options(protocol))
    http = protocol in ("http", "https")
    if not sized and http and not any(char in path for char in _URL_GLOB_CHARS):
        return [RemoteFile(url, fs, path, None, md5.lower() if md5 else None, "params" if md5 else "")]
    if any(char in path for char in (_URL_GLOB_CHARS if http else _GLOB_CHARS)):
        found: dict[str, dict[str, Any]] = fs.glob(path, detail=True)
        infos = [found[name] for name in sorted(found) if found[name].get("type", "file") == "file"]
        if not infos:
            raise FileNotFoundError(f"no files match the pattern {path}")
    else:
        infos = [fs.info(path)]
        if infos[0].get("type") == "directory":
            glob = f"{url.rstrip('/')}/*.csv"
            raise IsADirectoryError(f"{path} is a directory: name its files with a glob, such as {glob}")
    if md5 is not None and len(infos) > 1:
        raise ValueError(f"md5 names one file, but the pattern matches {len(infos)}")
    return [_remote_file(url, fs, info, md5, access) for info in infos]


def _remote_file(url: str, fs: AbstractFileSystem, info: Mapping[str, Any], md5: str | None,
                 access: Access) -> RemoteFile:
    size = info.get("size")
    expected, source = (md5.lower(), "params") if md5 else _md5_of(fs, info, access.verify_etag)
    return RemoteFile(url, fs, str(info["name"]), int(size) if size is not None else None, expected, source)


def _md5_of(fs: AbstractFileSystem, info: Mapping[str, Any], verify_etag: bool) -> tuple[str | None, str]:
    """The md5 a store vouches for: a single-part S3 object's ETag (a multipart ETag,
    ``"<hex>-<parts>"``, is not an md5), or an HTTP Content-MD5 header (base64)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    if verify_etag and "s3" in _protocols(fs) and _MD5.fullmatch(etag):
        return etag, "ETag"
    content_md5 = info.get("Content-MD5")
    if content_md5:
        try:
            return base64.b64decode(str(content_md5), validate=True).hex(), "Content-MD5"
        except (binascii.Error, ValueError):
            return None, ""
    return None, ""


@dataclass(frozen=True)
class Announced:
    """What a transfer was checked against: the size and md5 the source announced, where from."""

    size: int | None
    md5: str | None
    md5_from: str = ""


def download(file: RemoteFile, dest: Path, *, cancel: threading.Event, on_bytes: Callable[[int], None],
             on_size: Callable[[int | None], None] | None = None) -> Announced:
    """Stream ``file`` into ``dest`` (overwritten), then check its size and md5 against what the
    source announced (as listed, or, for a file listed without, in the answer to the GET).

    ``on_size``: told the size once the transfer knows it (None: the source does not say).
    Raises :class:`TransferIncomplete` (transient: the bytes were damaged on the way) when
    they differ from what the source announced, :class:`Cancelled` when ``cancel`` is set.
    """
    digest = hashlib.md5(usedforsecurity=False)
    written = 0
    with file.fs.open(file.path, "rb", **_stream_options(file)) as src, dest.open("wb") as sink:
        announced = _announced(file, src)
        if on_size is not None:
            on_size(announced.size)
        while chunk := src.read(CHUNK_BYTES):
            if cancel.is_set():
                raise Cancelled()
            sink.write(chunk)
            digest.update(chunk)
            written += len(chunk)
            on_bytes(len(chunk))
    if announced.size is not None and written != announced.size:
        raise TransferIncomplete(f"got {written} bytes, the source announced {announced.size}")
    if announced.md5 is not None and digest.hexdigest() != announced.md5:
        raise TransferIncomplete(f"md5 {digest.hexdigest()} does not match {announced.md5} ({announced.md5_from})")
    return announced


def _announced(file: RemoteFile, src: Any) -> Announced:
    """The size and md5 to check ``file``'s bytes against: as listed; for an HTTP file listed
    without them, the response's Content-Length (unless the body is encoded: aiohttp then
    hands over more bytes than it says) and Content-MD5."""
    headers = getattr(getattr(src, "r", None), "headers", None)  # fsspec's streamed HTTP file: aiohttp's response
    if file.size is not None or headers is None:
        return Announced(file.size, file.md5, file.md5_from)
    length = headers.get("Content-Length")
    encoded = headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
    size = int(length) if length is not None and length.isdigit() and not encoded else None
    if file.md5 is not None:
        return Announced(size, file.md5, file.md5_from)
    md5, source = _md5_of(file.fs, {"Content-MD5": headers.get("Content-MD5")}, verify_etag=False)
    return Announced(size, md5, source)


def read_range(file: RemoteFile, offset: int, length: int) -> bytes:
    """The lines that start in ``(offset, offset + length]`` (and the first line at 0),
    as ``fsspec.utils.read_block`` cuts them."""
    from fsspec.utils import read_block

    with file.fs.open(file.path, "rb", **_range_options(file, length)) as f:
        data: bytes = read_block(f, offset, length, delimiter=b"\n")
    return data


def data_start(file: RemoteFile, skip_rows: int) -> int:
    """The byte offset just past the first ``skip_rows`` lines (the header rows)."""
    if skip_rows == 0:
        return 0
    with file.fs.open(file.path, "rb", **_range_options(file, 1 << 16)) as f:
        for _ in range(skip_rows):
            f.readline()
        return int(f.tell())


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _stream_options(file: RemoteFile) -> dict[str, Any]:
    """Open options for one sequential pass: over HTTP a single streamed GET (block_size
    0), not ranged requests; the known size spares HTTP and S3 another HEAD. fsspec's HTTP
    file system asks for the size (a HEAD) whenever it is not given one, though a stream does
    not use it: a file listed without its size gets the GET alone (:func:`_announced`)."""
    protocols = _protocols(file.fs)
    if "http" in protocols:
        return {"block_size": 0, "size": file.size if file.size is not None else _SIZE_FROM_THE_ANSWER}
    if "s3" in protocols:
        return {"block_size": CHUNK_BYTES, "size": file.size}
    return {}


def _range_options(file: RemoteFile, length: int) -> dict[str, Any]:
    """Open options for reading about ``length`` bytes somewhere in the file: ranged
    requests of about that size (fsspec's HTTP default would fetch 5 MB per read)."""
    protocols = _protocols(file.fs)
    if "http" in protocols or "s3" in protocols:
        return {"block_size": max(length, 1 << 16), "size": file.size}
    return {}


def _with_timeout(protocol: str, options: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    """Add the connect/read timeout, unless the options set one themselves.

    Over HTTP this also lifts aiohttp's default 5-minute cap on a whole request, which
    would cut every large download; a stalled connection is what should time out.
    """
    if timeout_s is None:
        return options
    if protocol in ("http", "https"):
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s))
        return {**options, "client_kwargs": client}
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)
        return {**options, "config_kwargs": config}
    return options
