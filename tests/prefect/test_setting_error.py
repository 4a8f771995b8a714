"""A Prefect setting that does not validate is named in one line (conveyor.prefect.setting_error),
whether a variable or a profile set it; other validation errors are not taken for one."""

from __future__ import annotations

import pydantic
import pytest
from prefect.settings.models.flows import FlowsSettings

from conveyor.prefect.setting_error import invalid_setting


def test_a_variable_is_named_with_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "10")
    with pytest.raises(pydantic.ValidationError) as raised:
        FlowsSettings()
    said = invalid_setting(raised.value)
    assert said is not None and said.exit_code == 2
    assert str(said) == ("Prefect's settings: PREFECT_FLOWS_HEARTBEAT_FREQUENCY='10': Input should be greater "
                         "than or equal to 30: fix or unset it")


def test_a_value_from_elsewhere_is_named_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", raising=False)
    with pytest.raises(pydantic.ValidationError) as raised:
        FlowsSettings(heartbeat_frequency="often")  # type: ignore[arg-type]  # as a profile's text would be
    assert str(invalid_setting(raised.value)) == (
        "Prefect's settings: PREFECT_FLOWS_HEARTBEAT_FREQUENCY ('often', in a profile, prefect.toml or .env): "
        "Input should be a valid integer, unable to parse string as an integer: fix or unset it")


def test_other_errors_are_not_taken_for_a_setting() -> None:
    class Spec(pydantic.BaseModel):
        retries: int

    with pytest.raises(pydantic.ValidationError) as raised:
        Spec(retries="often")  # type: ignore[arg-type]
    assert invalid_setting(raised.value) is None
    assert invalid_setting(ValueError("FlowsSettings")) is None
