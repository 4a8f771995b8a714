"""Prefect's clients in a run share one TLS context per CA file (conveyor.prefect.tls)."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import certifi
import pytest

from conveyor.prefect import tls

API = "http://127.0.0.1:9/api"  # clients are made for it, never connected


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str | None]]:
    """The CA files of the contexts OpenSSL was asked to make from now on, the stand-in put in place."""
    import prefect._internal.version_checking as checking
    import prefect.client.orchestration as orchestration
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: API}):
        orchestration.get_client()  # what it imports at its first call makes contexts of its own (webhook blocks)
    calls: list[str | None] = []
    real = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        calls.append(kwargs.get("cafile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    monkeypatch.setattr(tls, "_MADE", {})
    for module in (orchestration, checking):
        monkeypatch.setattr(module, "ssl", ssl)  # as Prefect has it, whatever an earlier test did
    tls.share()
    yield calls


def test_a_runs_prefect_clients_make_one_context_and_verify_as_before(made: list[str | None]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: API}):
        for _ in range(2):  # the engine's client, the log and event workers' clients, twice
            get_client(sync_client=True)
            get_client()
            get_client()
        expected = PREFECT_API_SSL_CERT_FILE.value() or certifi.where()
    assert made == [expected]  # one context made, from the file Prefect names
    [context] = tls._MADE.values()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_changed_ca_file_gets_a_new_context_and_an_insecure_one_is_never_shared(
        made: list[str | None], tmp_path: Path) -> None:
    from prefect.client import orchestration

    bundle = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), bundle)
    first = orchestration.ssl.create_default_context(cafile=str(bundle))
    assert orchestration.ssl.create_default_context(cafile=str(bundle)) is first
    bundle.write_text(bundle.read_text() + "\n")  # rewritten: another size, another time
    assert orchestration.ssl.create_default_context(cafile=str(bundle)) is not first
    insecure = orchestration.ssl.create_default_context()
    insecure.check_hostname = False  # what Prefect does to it under PREFECT_API_TLS_INSECURE_SKIP_VERIFY
    assert orchestration.ssl.create_default_context() is not insecure
    assert made == [str(bundle), str(bundle), None, None]
    assert orchestration.ssl.CERT_NONE == ssl.CERT_NONE  # the rest of the module is ssl's
