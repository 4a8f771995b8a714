"""Flows whose parameters are plain JSON, recorded as they are.

Prefect stores a flow run's parameters after passing each through FastAPI's
``jsonable_encoder``, and importing FastAPI for it is a tenth of a second of every ``conveyor
run`` (nothing else in the run needs FastAPI). The pipeline flow's parameters are strings,
lists, mappings and booleans already: :class:`JsonParameters` records those as they are and
hands anything else to Prefect's own serialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Flow

P = ParamSpec("P")
R = TypeVar("R")


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


class JsonParameters(Flow[P, R]):
    """A Prefect flow that records parameters already JSON as they are (see the module)."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        if all(_plain(value) for value in parameters.values()):
            return {key: list(value) if isinstance(value, tuple) else value for key, value in parameters.items()}
        return super().serialize_parameters(parameters)


def json_flow(**options: Any) -> Callable[[Callable[P, R]], JsonParameters[P, R]]:
    """``@flow(...)`` making a :class:`JsonParameters` flow."""
    return lambda fn: JsonParameters(fn=fn, **options)
