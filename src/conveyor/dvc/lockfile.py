"""dvc.lock written in batches, so that recording a stage costs the same at any size of the file.

DVC rewrites the whole dvc.lock for every stage it records (parse, update, dump), so the
400th stage of a run paid for 400 entries (1.7 s against 0.18 s for the first). conveyor keeps
the file parsed for the whole run (it holds DVC's repository lock: no DVC command writes it
meanwhile) and writes it whole, in DVC's format, when stages finished since the last write and
at least ``WAIT_FACTOR`` times that write's duration has gone by: the writes take a bounded
share of the run whatever the size of the file, and a small file is written after every stage,
as before. The run's end (success, failure, Ctrl-C) writes what is left.

Between two writes, an entry that is not yet in dvc.lock is in the pending log
(``.conveyor/dvc-lock-pending``): a line appended and synced per stage before the outs journal
lets go of the stage's previous outs. After a kill -9 there, the next run merges the pending
entries into dvc.lock (under DVC's lock) if dvc.lock is still the file the log was started on
(nobody recorded anything since: a ``dvc repro`` in between wins), entry by entry where the
stage's outs in the workspace are still those its entry records; the rest are dropped (the stage
runs again, or comes back from DVC's run cache, where its outs were saved with the stage).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from conveyor.workspace import STATE_DIR, replace_atomically, state_dir

WAIT_FACTOR = 4.0  # wait this many times the last write's duration before the next: writes <= 1/5 of a run
PENDING = "dvc-lock-pending"

# (stage, its entry as dvc.lock would hold it): whether the outs in the workspace are the entry's
OutsMatch = Callable[[str, Mapping[str, Any]], bool]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_text(path: Path) -> str:
    """dvc.lock's text; empty when there is none."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""


def pending_path(root: Path, lock: Path) -> Path:
    """The pending log of ``lock``: one per dvc.lock a run writes (a pipeline across several
    dvc.yaml files records each stage beside its own); the root's keeps its name."""
    rel = os.path.relpath(lock, root)
    if rel == "dvc.lock":
        return root / STATE_DIR / PENDING
    return root / STATE_DIR / f"{PENDING}--{rel.replace(os.sep, '--')}"


def pending_entries(root: Path, lock: Path) -> dict[str, Any]:
    """The entries of the pending log that still apply (dvc.lock is the file the log started on),
    by stage, the last one of each stage; empty when there is none. Plain YAML: reads only."""
    import yaml

    base, entries = _read_log(pending_path(root, lock))
    if not entries or base != digest(read_text(lock)):
        return {}
    found: dict[str, Any] = {}
    for stage, text in entries:
        try:
            found[stage] = (yaml.safe_load(text) or {}).get(stage)
        except yaml.YAMLError:
            continue
    return found


def _read_log(path: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """The log's base (dvc.lock's sha256 when it began) and its entries as (stage, YAML text).
    A line cut short by a kill is skipped: its stage never returned from being recorded."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return None, []
    records = list(_parsed(lines))
    if not records or not isinstance(records[0].get("base"), str):
        return None, []
    entries = [(str(r["stage"]), str(r["yaml"])) for r in records[1:] if "stage" in r and "yaml" in r]
    return str(records[0]["base"]), entries


def _parsed(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


class LockWriter:
    """dvc.lock as one run writes it: parsed once, updated per stage, written in batches.

    ``track``: what DVC does to a file it wrote (``scm_context.track_file``: ``git add`` it
    when the user asked for auto-staging).
    """

    def __init__(self, path: Path, root: Path, track: Callable[[str], None]) -> None:
        self.path, self.root, self.track = path, root, track
        self.log = pending_path(root, path)
        self._data: Any = None  # DVC's round-trip YAML of dvc.lock, as this run last read or wrote it
        self._base = ""  # sha256 of dvc.lock's text as this run last read or wrote it (of "" for no file)
        self._fresh = False  # dvc.lock was absent or empty: DVC says it generates it
        self._pending: list[str] = []  # stages updated in memory since the last write
        self._written_at = float("-inf")
        self._write_s = 0.0

    def merge_pending(self, outs_match: OutsMatch) -> list[str]:
        """Write into dvc.lock what a killed run recorded only in the pending log (see the module's
        docstring); returns those stages. Called under DVC's lock, before anything reads dvc.lock."""
        base, entries = _read_log(self.log)
        if not entries:
            self.log.unlink(missing_ok=True)
            return []
        text = read_text(self.path)
        if base != digest(text):  # someone recorded after the kill: theirs wins
            self.log.unlink(missing_ok=True)
            return []
        from dvc.utils.serialize import parse_yaml_for_update

        self._read(text)
        merged: list[str] = []
        for stage, entry_text in entries:
            entry = parse_yaml_for_update(entry_text, str(self.log)).get(stage)
            if entry is not None and outs_match(stage, entry):
                self._data["stages"][stage] = entry
                merged.append(stage)
        if merged:
            self._write()
        self.log.unlink(missing_ok=True)
        return list(dict.fromkeys(merged))

    def update(self, stage: str, entry: Mapping[str, Any]) -> None:
        """The stage's new entry: in memory and in the pending log now, in dvc.lock when due."""
        from dvc.dvcfile import logger

        if self._data is None:
            self._read(read_text(self.path))
        relpath = os.path.relpath(self.path)
        if self._data["stages"].get(stage, {}) == entry and self.path.exists():
            return
        if self._fresh:
            self._fresh = False
            logger.info("Generating lock file '%s'", relpath)
        logger.info("Updating lock file '%s'", relpath)
        self._data["stages"][stage] = entry
        self._append(stage, entry)
        self._pending.append(stage)
        if time.monotonic() - self._written_at >= WAIT_FACTOR * self._write_s:
            self.flush()

    def flush(self) -> None:
        """Write what is pending into dvc.lock (the end of a run, or a write that is due)."""
        if self._pending:
            self._write()
            self.log.unlink(missing_ok=True)

    def _read(self, text: str) -> None:
        from dvc.utils.serialize import parse_yaml_for_update

        data: Any = parse_yaml_for_update(text, str(self.path)) if text else {}
        self._fresh = not data
        if not data:
            data = {"schema": "2.0"}  # first: DVC keeps the schema at the top
        data["stages"] = data.get("stages", {})
        self._data, self._base = data, digest(text)

    def _append(self, stage: str, entry: Mapping[str, Any]) -> None:
        """One line per stage, synced: a kill -9 or a reboot after it keeps the entry for the next run."""
        from dvc.utils.serialize import dumps_yaml

        state_dir(self.root)
        lines = "" if self._pending else json.dumps({"base": self._base}) + "\n"  # the file these entries update
        lines += json.dumps({"stage": stage, "yaml": dumps_yaml({stage: entry})}) + "\n"
        with self.log.open("w" if not self._pending else "a", encoding="utf-8") as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())

    def _write(self) -> None:
        """dvc.lock whole, through a temporary file renamed over it (DVC writes it in place: a kill
        -9 then leaves it empty, the project's whole record lost)."""
        from dvc.utils.serialize import dumps_yaml

        started = time.monotonic()
        text = dumps_yaml(self._data)
        replace_atomically(self.path, text, scratch=state_dir(self.root))
        self.track(os.path.relpath(self.path))
        self._base, self._pending = digest(text), []
        self._written_at = time.monotonic()
        self._write_s = self._written_at - started
        logging.getLogger(__name__).debug("wrote %s in %.3f s", self.path, self._write_s)
