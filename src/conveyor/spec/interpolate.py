"""``${dotted.key}`` in a stage's ``cmd``, ``deps``, ``outs``, ``metrics`` and ``wdir``.

Replaced by the value at that key of the params file, as DVC interpolates ``dvc.yaml``
from ``params.yaml``: ``${train.lr}`` reads ``params["train"]["lr"]``; ``\\${`` is a
literal ``${``. Only scalars interpolate (a mapping or a list is an error naming the key),
booleans as ``true``/``false`` as in YAML. An unknown key is a spec error with the file,
line and key path of the text that names it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from conveyor.errors import did_you_mean

PLACEHOLDER = re.compile(r"(\\)?\$\{([^}]*)\}")
FIELDS = ("cmd", "wdir", "deps", "outs", "metrics")


class InterpolationError(ValueError):
    """A ``${...}`` that names no usable value."""


def lookup(params: Mapping[str, Any], dotted: str) -> Any:
    """``params["train"]["xgb"]`` for ``"train.xgb"``; KeyError when absent."""
    value: Any = params
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def dotted_keys(params: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of ``params``, nested ones as ``a.b.c``."""
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        yield dotted
        if isinstance(value, Mapping):
            yield from dotted_keys(value, dotted + ".")


def interpolate(text: str, params: Mapping[str, Any], only: Callable[[str], bool] | None = None) -> str:
    """``text`` with each ``${key}`` replaced by its value in ``params``.

    ``only``: replace just the keys it accepts, leaving the others (and ``\\${``) as written
    for a later pass (a matrix item's ``${item.eta}`` first, the params file's keys after).
    """

    def value_of(match: re.Match[str]) -> str:
        key = match.group(2).strip()
        if only is not None and (match.group(1) or not only(key)):
            return match.group(0)
        if match.group(1):
            return match.group(0)[1:]  # \${ stays a literal ${
        try:
            value = lookup(params, key)
        except KeyError:
            raise InterpolationError(f"unknown param key '${{{key}}}'"
                                     f"{did_you_mean(key, list(dotted_keys(params)))}") from None
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str | int | float):
            return str(value)
        kind = "a mapping" if isinstance(value, Mapping) else "a list" if isinstance(value, list) else "null"
        raise InterpolationError(f"'${{{key}}}' is {kind}: interpolate a single value (a string or a number)")

    return PLACEHOLDER.sub(value_of, text)


def interpolate_stage(body: Mapping[str, Any], params: Mapping[str, Any],
                      only: Callable[[str], bool] | None = None) -> tuple[dict[str, Any], list[
        tuple[tuple[str | int, ...], str]]]:
    """A stage's raw body with its ``FIELDS`` interpolated, and the problems found.

    Each problem is ``(key path inside the stage, message)``; the value stays as written there.
    ``only`` as for :func:`interpolate`.
    """
    problems: list[tuple[tuple[str | int, ...], str]] = []

    def walk(value: Any, where: tuple[str | int, ...], keys_too: bool) -> Any:
        if isinstance(value, str):
            try:
                return interpolate(value, params, only)
            except InterpolationError as exc:
                problems.append((where, str(exc)))
                return value
        if isinstance(value, list):
            return [walk(v, (*where, i), keys_too) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            # a DVC-style out (``{path: {persist: true}}``) has its path as the key; a named
            # path has its path as the value (or under ``path``): both are interpolated.
            return {(walk(k, (*where, str(k)), False) if keys_too else k): walk(v, (*where, str(k)), keys_too)
                    for k, v in value.items()}
        return value

    result = dict(body)
    for name in FIELDS:
        if name in body:
            result[name] = walk(body[name], (name,), name in ("outs", "metrics"))
    return result, problems
