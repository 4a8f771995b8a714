"""Past runs side by side: ``conveyor runs`` and ``conveyor compare`` (SPEC.md section 4).

Everything here is read from the run records (``.conveyor/runs/<run_id>.json``, section 5);
nothing is run, imported from the project or asked of Prefect. A record that cannot be read
(corrupt JSON, a field of the wrong type) is left out, never fatal.

``compare`` lays runs out as ``dvc exp show`` does: a row per run, its params, then its
metrics, one column per ``stage:metric``. A matrix item (``train@0.1-6``) gets a row of its
own under its run, its values as ``item.*`` params and its metrics under its group's name
(``train:acc``), so the same item of two runs lines up in the same columns::

                             train.   item.   item.   evaluate:   train:
    run                      rounds     eta   depth         auc      acc
    20261124T100000-aaaaaa      100       -       -         0.9        -     the run: evaluate's metric
    ├ train@0.1-6               100     0.1       6           -      0.6     its items
    └ train@0.3-6               100     0.3       6           -      1.8

    20261124T100500-bbbbbb     200*       -       -        0.91        -     * set with -S in that run

A run's own row appears when it has no matrix items or has metrics of other stages. When a
row per run is wider than the terminal and the table turned is narrower, it is shown turned
(a row per param and metric, a column per run or item). :func:`rows_of` builds the rows
once (:mod:`conveyor.run.compare`), for the table, the ``--plot`` page (:mod:`conveyor.cli.chart`)
and the Prefect table artifact of a run.
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Iterable, Sequence
from datetime import datetime

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from conveyor.errors import UsageError
from conveyor.run.compare import MARK, Columns, Row, cells, changed_from, columns_of, fmt, plain
from conveyor.run.live import STYLE
from conveyor.run.record import RunRecord
from conveyor.run.schedule import Outcome

RAN = (Outcome.SUCCEEDED.value, Outcome.FAILED.value, "interrupted")  # statuses of stages that ran

def of_spec(runs: Iterable[RunRecord], spec: str, *, default: bool) -> list[RunRecord]:
    """The runs of the spec ``spec`` (relative to the root); records older than the ``spec``
    field (``""``) count as runs of the default spec."""
    return [r for r in runs if r.spec == spec or (default and not r.spec)]


def pick(wanted: Sequence[str], runs: Sequence[RunRecord], others: Sequence[RunRecord]) -> list[RunRecord]:
    """The runs named by ``wanted`` (ids or unique prefixes), in that order; one UsageError for
    every id that names none, or several, of ``runs`` (``others``: the runs of other specs)."""
    found: list[RunRecord] = []
    problems: list[str] = []
    for name in dict.fromkeys(wanted):
        matches = _matching(name, runs)
        if len(matches) == 1:
            found.append(matches[0])
        elif matches:
            problems.append(f"run '{name}' is ambiguous: it starts {len(matches)} run ids "
                            f"({', '.join(r.run_id for r in matches[:3])}{', ...' if len(matches) > 3 else ''})")
        else:
            problems.append(_unknown(name, runs, others))
    if problems:
        raise UsageError("; ".join(problems))
    return found


def _matching(name: str, runs: Sequence[RunRecord]) -> list[RunRecord]:
    exact = [r for r in runs if r.run_id == name]
    return exact or [r for r in runs if r.run_id.startswith(name)]


def _unknown(name: str, runs: Sequence[RunRecord], others: Sequence[RunRecord]) -> str:
    elsewhere = _matching(name, others)
    if len(elsewhere) == 1:
        spec = elsewhere[0].spec
        return f"run '{name}' is a run of {spec}: pass -c {spec}" if spec else \
            f"run '{name}' is a run of the default spec: leave out -c"
    ids = [r.run_id for r in runs]
    close = difflib.get_close_matches(name, ids, n=3, cutoff=0.5)
    if close:
        return f"unknown run '{name}' (close: {', '.join(close)})"
    latest = ", ".join(reversed(ids[-3:]))
    return f"unknown run '{name}'" + (f" (latest: {latest}; `conveyor runs` lists them)" if ids else
                                      " (no runs of this spec yet)")


# ------------------------------------------------------------------- conveyor runs

def runs_table(runs: Sequence[RunRecord]) -> Table:
    """``conveyor runs``: one line per run, in the order given; ``ran`` counts failed stages too."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("run", "started", "status", "wall", "ran", "skipped", "failed", "overrides"):
        table.add_column(name, justify="right" if name in ("wall", "ran", "skipped", "failed") else "left")
    for run in runs:
        states = [s.status for s in run.stages.values()]
        table.add_row(run.run_id, local_time(run.started), _status(run.status), f"{run.wall_s:.1f}s",
                      str(sum(s in RAN for s in states)), str(states.count(Outcome.SKIPPED.value)),
                      str(states.count(Outcome.FAILED.value)),
                      " ".join(f"{k}={fmt(v)}" for k, v in run.overrides.items()))
    return table


def natural_width(table: Table) -> int:
    """How wide ``table`` is with nothing wrapped or cut: a run id must stay whole to be copied."""
    return Console(width=10_000, file=io.StringIO()).measure(table).maximum


def local_time(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError):
        return str(iso)


def _status(status: str) -> Text:
    return Text(status, style=STYLE.get(status, ""))


# ------------------------------------------------------------------- conveyor compare

def compare_table(rows: Sequence[Row], title: str = "", width: int = 80, every: bool = False) -> Table:
    """``conveyor compare``: a row per run or item (``dvc exp show``) when that fits in ``width``
    columns, else whichever is narrower of it and the same table turned (a row per param and
    metric, a column per run or item): what a pipeline with many metrics needs. Of the params,
    only those that tell the rows apart unless ``every`` (:func:`~conveyor.run.compare.columns_of`)."""
    columns = columns_of(rows, every)
    hidden = len(columns_of(rows).params) - len(columns.params)
    wide, turned = _wide(rows, title, columns, hidden), _turned(rows, title, columns, hidden)
    need = natural_width(wide)
    return wide if need <= width or need <= natural_width(turned) else turned


def _wide(rows: Sequence[Row], title: str, columns: Columns, hidden: int) -> Table:
    """A row per run, its items under it: params (yellow), then metrics (cyan), each header on
    two lines (``train.`` over ``eta``) to keep the columns narrow; a param that changed since
    the run before (the same item's row) in bold."""
    table = _titled(rows, title, hidden)
    table.add_column("run", no_wrap=True)
    for key in columns.params:
        table.add_column(_header(key, "."), header_style="bold yellow", justify="right")
    for key in columns.metrics:
        table.add_column(_header(key, ":"), header_style="bold cyan", justify="right")
    blank = [""] * (len(columns.params) + len(columns.metrics))
    with_items = any(r.item for r in rows)  # then a blank line after each run's rows
    for i, (row, changed) in enumerate(zip(rows, changed_from(rows), strict=True)):
        first = i == 0 or rows[i - 1].run_id != row.run_id
        last = i == len(rows) - 1 or rows[i + 1].run_id != row.run_id
        if first and row.item:  # a run whose rows are all items: its id heads them
            table.add_row(row.run_id, *blank)
        name = f"{'└' if last else '├'} {row.item}" if row.item else row.run_id
        values = [Text(v, style="bold" if key in changed else "")
                  for key, v in zip((*columns.params, *columns.metrics), cells(row, columns)[2:], strict=True)]
        table.add_row(name, *values, end_section=last and with_items)
    return table


def _header(key: str, sep: str) -> str:
    """``train.eta`` as ``train.`` over ``eta``; ``evaluate:xgb.auc`` as ``evaluate:`` over ``xgb.auc``."""
    head, found, tail = key.rpartition(sep) if sep == "." else key.partition(sep)
    return f"{head}{found}\n{tail}" if found and head and tail else key


def _turned(rows: Sequence[Row], title: str, columns: Columns, hidden: int) -> Table:
    """A row per param, then per metric; a column per run or item. Values that differ are bold."""
    table = _titled(rows, title, hidden)
    table.add_column("", no_wrap=True)
    for row in rows:
        table.add_column(f"{row.run_id}\n{row.item}" if row.item else row.run_id, justify="right",
                         overflow="fold")
    text = [cells(row, columns)[2:] for row in rows]
    for i, key in enumerate((*columns.params, *columns.metrics)):
        values = [t[i] for t in text]
        differ = len({v.rstrip(MARK) for v in values}) > 1
        table.add_row(Text(key, style="yellow" if i < len(columns.params) else "cyan"),
                      *(Text(v, style="bold" if differ else "") for v in values),
                      end_section=i == len(columns.params) - 1)
    return table


def _titled(rows: Sequence[Row], title: str, hidden: int = 0) -> Table:
    notes = [f"{MARK} set with -S in that run"] if any(r.overridden for r in rows) else []
    if hidden:
        notes.append(f"{hidden} param{'s' if hidden != 1 else ''} the same in every row not shown (--all shows them)")
    caption = "; ".join(notes) or None
    return Table(title=title or None, title_justify="left", caption=caption, caption_justify="left",
                 box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                 min_width=len(title) or None)  # a table narrower than its title (no params, no metrics) folded it


def machine_rows(rows: Sequence[Row], form: str) -> str:
    """``compare --json``/``--csv``: every row with every param, values as the record has them
    (lists unfolded, credentials redacted), for scripts."""
    import csv
    import json

    columns = columns_of(rows)
    if form == "json":
        records = [{"run": row.run_id, "item": row.item or None,
                    "params": {k: plain(row.params[k]) for k in columns.params if k in row.params},
                    "set_with_S": sorted(row.overridden),
                    "metrics": {k: row.metrics[k] for k in columns.metrics if k in row.metrics}} for row in rows]
        return json.dumps(records, indent=2, default=str) + "\n"
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", "item", *columns.params, *columns.metrics])
    for row in rows:
        writer.writerow([row.run_id, row.item,
                         *(_csv_cell(plain(row.params[k]) if k in row.params else None) for k in columns.params),
                         *(_csv_cell(row.metrics.get(k)) for k in columns.metrics)])
    return buffer.getvalue()


def _csv_cell(value: object) -> str:
    import json

    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)
