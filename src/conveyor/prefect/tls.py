"""One TLS context per CA file for Prefect's clients in this process, instead of one per client.

Each Prefect client builds a verified ``ssl.SSLContext`` from its CA file (``PREFECT_API_SSL_CERT_FILE``,
else certifi's bundle) as it is created, also for an ``http://`` API where no TLS is ever spoken:
OpenSSL parses the bundle's certificates each time, 16 to 20 ms. A flow run creates four (the
engine's client, the log and event workers' clients and the events client's version check):
measured on a forced two-stage run forked by the warm runner, 0.39 CPU-s with them, 0.31 with
one, 0.30 with the runner's (:func:`context`, made before it forks).
Upstream: PrefectHQ/prefect#19106 lets a caller pass one context, which the engine and workers
cannot be given.

:func:`share` gives Prefect's client modules a stand-in for ``ssl`` whose
``create_default_context(cafile=FILE)`` returns the context made from ``FILE`` as it is now (its
path, size, modification time and inode: a changed file gets a new one); every other call is the
``ssl`` module's. Only verified contexts are shared, which nothing changes after making them (the
``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` path, which turns verification off on the context it gets,
gets its own each time, as before). Verification is unchanged: the same file, the same settings.
"""

from __future__ import annotations

import os
import ssl
import threading
from typing import Any

# where Prefect's clients make their contexts: the REST clients and the version check
MODULES = ("prefect.client.orchestration", "prefect._internal.version_checking")

_MADE: dict[tuple[str, int, int, int], ssl.SSLContext] = {}
_LOCK = threading.Lock()


class _SharedContexts:
    """Stands for the ``ssl`` module in :data:`MODULES` (see the module's doc)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    def create_default_context(self, purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH, *, cafile: str | None = None,
                               capath: str | None = None, cadata: str | bytes | None = None) -> ssl.SSLContext:
        if cafile is None or capath is not None or cadata is not None or purpose != ssl.Purpose.SERVER_AUTH:
            return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        try:
            st = os.stat(cafile)
        except OSError:  # as ssl would: its error names the file
            return ssl.create_default_context(purpose, cafile=cafile)
        key = (os.path.abspath(cafile), st.st_size, st.st_mtime_ns, st.st_ino)
        with _LOCK:
            context = _MADE.get(key)
            if context is None:
                context = _MADE[key] = ssl.create_default_context(purpose, cafile=cafile)
            return context


def share() -> None:
    """Prefect's clients in this process share one context per CA file from now on (imports them)."""
    import importlib

    stand_in = _SharedContexts()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another Prefect: its clients make their own, as before
            continue
        if getattr(module, "ssl", None) is ssl:
            setattr(module, "ssl", stand_in)  # noqa: B010  # the attribute Prefect reads


def context() -> ssl.SSLContext:
    """The shared context of the CA file Prefect's clients use (``PREFECT_API_SSL_CERT_FILE``, which
    ``SSL_CERT_FILE`` also sets, else certifi's bundle), made now if it is not yet: for a client made
    here (``httpx_settings={"verify": context()}``)."""
    import certifi
    from prefect.settings import PREFECT_API_SSL_CERT_FILE

    return _SharedContexts().create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
