"""The Prefect settings a run records under on a local server are Prefect's own update of those in
force (conveyor.prefect.server._for_local_server copies them instead of validating them anew)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("configured", [
    {},
    {"PREFECT_UI_URL": "http://127.0.0.1:9/ui", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
     "PREFECT_API_URL": "http://127.0.0.1:8/api", "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true"},
    {"PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false"},
], ids=["defaults", "set", "csrf-support-off"])
def test_the_copy_is_what_prefects_update_gives(monkeypatch: pytest.MonkeyPatch, configured: dict[str, str]) -> None:
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        Settings,
    )

    from conveyor.prefect.server import _for_local_server

    for name, value in configured.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    url = "http://127.0.0.1:5/api"
    copied = _for_local_server(settings, url)
    updated = settings.copy_with_update(updates={
        PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_UI_URL: "",
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False})
    # field names Prefect renamed would be new attributes of the copy, not these settings
    assert (copied.api.url, copied.flows.heartbeat_frequency, copied.ui_url) == (url, None, "")
    # no version handshake with this Prefect's own server; CSRF tokens as configured (a kept server
    # started with its CSRF protection on refuses a client without them)
    assert copied.client.server_version_check_enabled is False
    assert copied.client.csrf_support_enabled is (configured.get("PREFECT_CLIENT_CSRF_SUPPORT_ENABLED") != "false")
    assert copied.model_dump(exclude_unset=True) == updated.model_dump(exclude_unset=True)
    assert copied.to_environment_variables(exclude_unset=True) == updated.to_environment_variables(exclude_unset=True)
    assert (settings.api.url, settings.ui_url) != (url, "")  # the settings copied from are left as they were
    assert settings.client.server_version_check_enabled
