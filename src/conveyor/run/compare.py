"""The rows of ``conveyor compare``: a run, or one matrix item of a run, with its params and
metrics (data only; the tables are :mod:`conveyor.cli.history`'s). Built once for the table, the
``--plot`` page and the Prefect table artifact of a run (:func:`artifact_rows`)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.errors import redact
from conveyor.run.record import RunRecord, StageRecord
from conveyor.spec.matrix import JOIN

MISSING = "-"  # a value a run (or item) does not have
MARK = "*"  # after a param value set with -S in that run
ITEM = "item."  # the prefix of a matrix item's values among the params


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Row:
    """One row of ``conveyor compare``: a run, or one matrix item of a run (``item`` its stage)."""

    run_id: str
    item: str  # the matrix item's stage (train@0.1-6); "" for the run's own row
    params: Mapping[str, Any]  # dotted key -> value, the item's values as item.<key>
    overridden: frozenset[str]  # the params set with -S in this run
    metrics: Mapping[str, float]  # stage:metric -> value; an item's under its group's name


@dataclass(frozen=True, slots=True)
class Columns:
    params: tuple[str, ...]
    metrics: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return ("run", "item", *self.params, *self.metrics)


def rows_of(runs: Sequence[RunRecord]) -> list[Row]:
    """The rows comparing ``runs``, in their order: each run's own row (when it has no matrix
    items or has metrics of other stages), then a row per item of a matrix that has metrics."""
    measured = {_group(n) for r in runs for n, s in r.stages.items() if s.item is not None and s.metrics}
    rows: list[Row] = []
    for run in runs:
        params = flatten(run.params)
        params.update({k: v for k, v in run.overrides.items() if k not in params})  # a key of another params file
        marked = frozenset(k for k in params if any(k == o or k.startswith(f"{o}.") for o in run.overrides))
        plain = {f"{n}:{k}": v for n, s in run.stages.items() if s.item is None for k, v in s.metrics.items()
                 if _number(v)}
        items = ranked(run, [(n, s) for n, s in run.stages.items() if s.item is not None and _group(n) in measured])
        if plain or not items:
            rows.append(Row(run.run_id, "", params, marked, plain))
        for name, stage in items:
            values = {**params, **flatten(stage.item or {}, ITEM.rstrip("."))}
            metrics = {f"{_group(name)}:{k}": v for k, v in stage.metrics.items() if _number(v)}
            rows.append(Row(run.run_id, name, values, marked, metrics))
    return rows


def ranked(run: RunRecord, items: list[tuple[str, StageRecord]]) -> list[tuple[str, StageRecord]]:
    """A search's trials best first by its objective (those without it last); a matrix's items as they ran."""
    if not run.search or not isinstance(run.search.get("metric"), str):
        return items
    metric = run.search["metric"].partition(":")[2]
    sign = 1.0 if run.search.get("minimize", True) else -1.0

    def order(entry: tuple[str, StageRecord]) -> tuple[bool, float]:
        value = entry[1].metrics.get(metric)
        return (value is None, sign * value if value is not None else 0.0)

    return sorted(items, key=order)


def _group(stage: str) -> str:
    return stage.partition(JOIN)[0]


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"eta": 0.1}}`` as ``{"train.eta": 0.1}``: a param section as its leaves."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def columns_of(rows: Iterable[Row], every: bool = True) -> Columns:
    """Params (a run's, then items' values) and metrics, each in the order they first appear.

    ``every`` False: of the params, only those that tell the rows apart (what ``dvc exp show``
    users read a comparison for: what changed and what it did), those set with ``-S``, and the
    items' values; all of them when there is one row (nothing to tell apart)."""
    rows = list(rows)
    params: dict[str, None] = {}
    items: dict[str, None] = {}
    metrics: dict[str, None] = {}
    for row in rows:
        for key in row.params:
            (items if key.startswith(ITEM) else params)[key] = None
        metrics.update(dict.fromkeys(row.metrics))
    if not every and len(rows) > 1:
        params = {key: None for key in params if changes(rows, key) or any(key in r.overridden for r in rows)}
    return Columns((*params, *items), tuple(metrics))


def changes(rows: Sequence[Row], key: str) -> bool:
    """Whether the param ``key`` has more than one value (or is missing somewhere) among ``rows``."""
    return len({json.dumps(r.params.get(key, MISSING), sort_keys=True, default=str) for r in rows}) > 1


def changed_from(rows: Sequence[Row]) -> list[frozenset[str]]:
    """Per row, the params whose value differs from the row before it of the same item (the previous
    run's), as ``dvc exp show`` marks a changed cell; nothing for a row with none before it."""
    last: dict[str, Row] = {}
    marked: list[frozenset[str]] = []
    for row in rows:
        before = last.get(row.item)
        keys = set(row.params) | set(before.params if before else ())
        marked.append(frozenset(k for k in keys if before is not None
                                and before.params.get(k, MISSING) != row.params.get(k, MISSING)))
        last[row.item] = row
    return marked


def cells(row: Row, columns: Columns) -> list[str]:
    """A row as text, in the order of ``columns.names``: ``-`` for what it does not have."""
    params = [fmt(row.params[k]) + (MARK if k in row.overridden else "") if k in row.params else MISSING
              for k in columns.params]
    metrics = [fmt(row.metrics[k]) if k in row.metrics else MISSING for k in columns.metrics]
    return [row.run_id, row.item or MISSING, *params, *metrics]


FOLD_ABOVE = 40  # characters: a list or mapping longer than this is shown as its size and a digest


def fmt(value: Any) -> str:
    """A param or metric value as the table shows it: floats to 4 significant digits, URLs without
    credentials, a long list or mapping folded to its size and a digest (``[31 items #3f2a9c]``: two
    runs' lists differ when their digests do)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return redact(value)  # a source URL's password
    text = redact(json.dumps(value, default=str))
    if len(text) <= FOLD_ABOVE or not isinstance(value, list | tuple | Mapping):
        return text
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:6]
    size = f"{len(value)} keys" if isinstance(value, Mapping) else f"{len(value)} items"
    return f"{'{' if isinstance(value, Mapping) else '['}{size} #{digest}{'}' if isinstance(value, Mapping) else ']'}"


def plain(value: Any) -> Any:
    """A value for ``--json``/``--csv``: as the record has it (unfolded), credentials redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list | tuple | Mapping):
        return json.loads(redact(json.dumps(value, default=str)))
    return value


def artifact_rows(run: RunRecord) -> list[dict[str, str]]:
    """The rows of ``conveyor compare RUN`` for one run, as a Prefect table artifact takes them."""
    rows = rows_of([run])
    columns = columns_of(rows)
    return [dict(zip(columns.names, cells(row, columns), strict=True)) for row in rows]
