"""A Prefect setting that does not validate (a ``PREFECT_*`` variable, a profile's or ``prefect.toml``'s
value), as one line naming it instead of pydantic's traceback from the first import of Prefect."""

from __future__ import annotations

import os
from typing import Any

from conveyor.errors import UsageError


def invalid_setting(exc: BaseException) -> UsageError | None:
    """``exc`` as a :class:`UsageError` (exit 2) when it is pydantic's verdict on one of Prefect's
    settings models; None for anything else."""
    import pydantic

    if not isinstance(exc, pydantic.ValidationError):
        return None
    model = _settings_model(exc.title)
    if model is None:
        return None
    prefix = str(model.model_config.get("env_prefix") or "PREFECT_")
    problems = []
    for error in exc.errors():
        name = prefix + "_".join(str(part) for part in error["loc"]).upper()
        value = error.get("input")
        where = f"{name}={value!r}" if name in os.environ else f"{name} ({value!r}, in a profile, prefect.toml or .env)"
        problems.append(f"{where}: {error['msg']}")
    return UsageError(f"Prefect's settings: {'; '.join(problems)}: fix or unset it")


def _settings_model(title: str) -> Any:
    """The class of Prefect's settings named ``title`` (``FlowsSettings``), or None."""
    try:
        from prefect.settings.base import PrefectBaseSettings
    except ImportError:
        return None
    found: list[type] = [PrefectBaseSettings]
    while found:
        model = found.pop()
        if model.__name__ == title:
            return model
        found.extend(model.__subclasses__())
    return None
