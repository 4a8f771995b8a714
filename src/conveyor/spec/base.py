"""What every spec model shares: the frozen base model, and sizes as Dask reads them."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


class Model(BaseModel):
    """Frozen, and a key it does not know is an error (a misspelt key never passes silently)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def check_bytes(value: str | None) -> str | None:
    if value is not None and value != "auto" and not BYTES.match(value):
        raise ValueError(f"'{value}' is not a size: write it like 4GiB, 512MB or auto")
    return value


def check_size(value: str | None) -> str | None:
    if value is not None and not BYTES.match(value):
        raise ValueError(f"'{value}' is not a size: write it like 64MiB or 500KB")
    return value


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(text: str) -> int:
    """``64MiB`` -> 67108864, as Dask reads sizes (``MB`` is 10**6, ``MiB`` 2**20)."""
    match = BYTES.match(text)
    if match is None:
        raise ValueError(f"'{text}' is not a size")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
