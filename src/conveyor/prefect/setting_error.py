"""What Prefect's configuration gets wrong, as one line instead of Prefect's traceback: a setting that
does not validate (a ``PREFECT_*`` variable, a profile's or ``prefect.toml``'s value), seen as Prefect
is first imported; an API that refuses the requests for want of credentials, seen at the first.
(A server that is not there or stops answering: :mod:`conveyor.prefect.server`.)"""

from __future__ import annotations

import os
import sys
from typing import Any

from conveyor.errors import ConveyorError, PrefectServerRefused, UsageError


def explained(exc: BaseException) -> ConveyorError | None:
    """``exc`` as the one line :func:`invalid_setting` or :func:`refused` make of it; None for anything else."""
    return invalid_setting(exc) or refused(exc)


def refused(exc: BaseException) -> PrefectServerRefused | None:
    """``exc``, or an error that caused it, as :class:`PrefectServerRefused` when it is Prefect's client told
    HTTP 401 or 403 by the API of ``PREFECT_API_URL``; None otherwise."""
    if "prefect.exceptions" not in sys.modules:
        return None
    from prefect.exceptions import PrefectHTTPStatusError

    seen: BaseException | None = exc
    for _ in range(20):  # the chain of causes, bounded (a chain can loop)
        if seen is None:
            break
        if isinstance(seen, PrefectHTTPStatusError) and seen.response.status_code in (401, 403):
            url = os.environ.get("PREFECT_API_URL") or str(seen.request.url)
            return PrefectServerRefused(url, f"HTTP {seen.response.status_code} {seen.response.reason_phrase}")
        seen = seen.__cause__ or seen.__context__
    return None


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
