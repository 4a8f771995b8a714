"""The model registry: which model is the champion, and every challenger that tried.

``models/registry.json`` holds the champion and the history of candidates: their
metrics, data version, git commit, run id and time. A retraining run appends exactly one
candidate; it replaces the champion only when :class:`PromotionRule` says the challenger
is better by the margin. A promoted model is copied aside (``models/champions/<run_id>/``)
so later runs, which rewrite the model out, cannot change the champion under its name.

Plain files, no Prefect: every write goes to a temporary sibling and is renamed into
place, and a read-modify-write holds an exclusive lock on the registry, so a failed or
concurrent run never leaves a torn registry or a champion it did not choose.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from conveyor.errors import RegistryError, did_you_mean
from conveyor.run.metrics import numbers
from conveyor.workspace import replace_atomically

if TYPE_CHECKING:
    from conveyor.spec.project import Project

Direction = Literal["max", "min"]
Status = Literal["promoted", "rejected", "failed"]
TOLERANCE = 1e-12  # an improvement equal to min_delta must not lose to float rounding


@dataclass(frozen=True)
class MetricRef:
    """A number in a metrics file: ``metrics/test.json:stack.auc`` (file, then dotted key)."""

    path: str
    key: str

    @classmethod
    def parse(cls, text: str) -> MetricRef:
        path, sep, key = text.rpartition(":")
        if not sep or not path or not key or key.startswith(".") or key.endswith("."):
            raise RegistryError(f"metric {text!r}: write it as FILE:KEY, e.g. metrics/test.json:stack.auc")
        return cls(path, key)

    def __str__(self) -> str:
        return f"{self.path}:{self.key}"


@dataclass(frozen=True)
class PromotionRule:
    """When a challenger replaces the champion: better on ``metric`` by at least ``min_delta``."""

    metric: MetricRef
    direction: Direction = "max"
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.direction not in get_args(Direction):
            raise RegistryError(f"direction {self.direction!r}: use max (higher is better) or min (lower is better)")
        if not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise RegistryError(f"min_delta {self.min_delta}: the margin is a number >= 0")

    def improvement(self, challenger: float, champion: float) -> float:
        """How much better the challenger is (negative: worse), in the rule's direction."""
        return challenger - champion if self.direction == "max" else champion - challenger


@dataclass(frozen=True)
class Decision:
    """Whether the challenger is promoted, and why, in one line."""

    promote: bool
    reason: str


@dataclass(frozen=True)
class Candidate:
    """One retraining run's model, as the registry remembers it."""

    run_id: str
    time: str
    status: Status
    reason: str
    metric: str
    value: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    model: str = ""
    model_md5: str | None = None
    stored: str | None = None  # the champion's copy, relative to the project root
    files: Mapping[str, str] = field(default_factory=dict)  # the spec's model files: name -> copy's path
    version: str | None = None  # their hash (conveyor.predict.model.version_of), what /model answers
    data_version: Mapping[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    flow_run_id: str | None = None

    def value_of(self, ref: MetricRef) -> float | None:
        """This candidate's value for ``ref``: its own metric, or another key of the same file."""
        if str(ref) == self.metric:
            return self.value
        file = MetricRef.parse(self.metric).path if self.metric else None
        return self.metrics.get(ref.key) if file == ref.path else None


@dataclass(frozen=True)
class Registry:
    """The champion (None before the first promotion) and every candidate, oldest first."""

    champion: Candidate | None = None
    history: tuple[Candidate, ...] = ()

    def add(self, candidate: Candidate) -> Registry:
        """The registry after ``candidate``: one more history entry, a new champion only if promoted."""
        champion = candidate if candidate.status == "promoted" else self.champion
        return Registry(champion, (*self.history, candidate))

    def to_dict(self) -> dict[str, Any]:
        return {"champion": _plain(self.champion), "history": [_plain(c) for c in self.history]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Registry:
        champion = data.get("champion")
        return cls(_candidate(champion) if champion else None,
                   tuple(_candidate(c) for c in data.get("history", [])))


def _plain(candidate: Candidate | None) -> dict[str, Any] | None:
    return None if candidate is None else asdict(candidate)


def _candidate(data: Mapping[str, Any]) -> Candidate:
    return Candidate(**{k: v for k, v in data.items() if k in Candidate.__dataclass_fields__})


def decide(rule: PromotionRule, challenger: float, champion: Candidate | None) -> Decision:
    """Promote only a challenger better than the champion by at least the margin."""
    if not math.isfinite(challenger):
        return Decision(False, f"challenger's {rule.metric.key} is {challenger}: not a comparable number")
    if champion is None:
        return Decision(True, f"no champion yet: {rule.metric.key} = {challenger:.6g} becomes the champion")
    held = champion.value_of(rule.metric)
    if held is None or not math.isfinite(held):
        return Decision(False, f"the champion has no comparable {rule.metric} (it was judged on "
                        f"{champion.metric}): kept; compare on that metric or reset the registry")
    gain = rule.improvement(challenger, held)
    versus = f"{rule.metric.key} {challenger:.6g} vs champion {held:.6g} ({rule.direction} is better)"
    if gain <= 0:
        return Decision(False, f"not better: {versus}")
    if gain < rule.min_delta - TOLERANCE:
        return Decision(False, f"better by {gain:.6g}, less than min_delta {rule.min_delta:g}: {versus}")
    return Decision(True, f"better by {gain:.6g} (min_delta {rule.min_delta:g}): {versus}")


def read_metrics(root: Path, ref: MetricRef) -> tuple[float, dict[str, float]]:
    """The value of ``ref`` and every number in its file (flattened to dotted keys)."""
    path = root / ref.path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RegistryError(f"metrics file {ref.path} not found: did the stage that writes it run?") from None
    except (OSError, ValueError) as exc:
        raise RegistryError(f"metrics file {ref.path} is not readable JSON: {exc}") from exc
    found = dict(numbers(data))
    if ref.key not in found:
        hint = did_you_mean(ref.key, found) or f"; numbers in it: {', '.join(found) or 'none'}"
        raise RegistryError(f"metrics file {ref.path} has no number at '{ref.key}'{hint}")
    return found[ref.key], found


def load(path: Path) -> Registry:
    """The registry at ``path``; an empty one when the file does not exist yet."""
    if not path.exists():
        return Registry()
    try:
        return Registry.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise RegistryError(f"model registry {path} is unreadable ({exc}): fix or move it; "
                            "it was left as it is") from exc


def save(path: Path, registry: Registry) -> None:
    """Replace the registry file whole (on disk before the rename): a kill leaves the old one or the new."""
    replace_atomically(path, json.dumps(registry.to_dict(), indent=2) + "\n", durable=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the registry for one read-modify-write."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_name(f".{path.name}.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def store_model(root: Path, model: str, folder: Path) -> str:
    """Copy the model out (a file or a directory) into ``folder``; returns the copy's path under root.

    The copy is made next to its final place and renamed into it, so it is there whole or not at all.
    """
    source = root / model
    if not source.exists():
        raise RegistryError(f"model {model} not found: did the stage that writes it run?")
    target = folder / source.name
    tmp = folder / f".{source.name}.{uuid.uuid4().hex[:8]}.tmp"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if source.is_dir():
            shutil.copytree(source, tmp)
        else:
            shutil.copy2(source, tmp)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return target.relative_to(root).as_posix()


def locked_outs(project: Project) -> dict[str, str]:
    """md5 of every out at its last success: from dvc.lock under DVC, else conveyor's own lock."""
    import yaml

    from conveyor.dvc.compile import compiled_from
    from conveyor.plan.fingerprint import LockRecord

    if compiled_from(project):
        data = yaml.safe_load((project.root / "dvc.lock").read_text(encoding="utf-8")) \
            if (project.root / "dvc.lock").exists() else None
        stages = (data or {}).get("stages", {})
    else:
        stages = LockRecord.for_project(project).stages()
    return {o["path"]: o["md5"] for body in stages.values() for o in body.get("outs", []) if "md5" in o}


def md5_of(root: Path, rel: str) -> str | None:
    """The md5 DVC would record for the file or directory ``rel`` (None if it does not exist)."""
    from conveyor.plan.fingerprint import Hasher

    entry = Hasher().entry(root, rel)
    return entry.md5 if entry is not None else None


def data_version(project: Project, stages: Sequence[str]) -> dict[str, str]:
    """The md5 of each out of ``stages`` (the data sources) at its last success, else as it is now."""
    locked = locked_outs(project)
    outs = [o for s in stages for o in project.pipeline.stages[s].written]
    return {o: m for o in outs if (m := locked.get(o) or md5_of(project.root, o))}


def comparison_markdown(title: str, rule: PromotionRule, champion: Candidate | None, challenger: Candidate) -> str:
    """The comparison table and the decision, as published with each retraining run."""
    key = str(rule.metric)

    def row(role: str, c: Candidate | None) -> str:
        if c is None:
            return f"| {role} | (none) | | | | | |"
        value = c.value_of(rule.metric)
        shown = "" if value is None else f"{value:.6g}"
        data = ", ".join(f"{p} {m[:12]}" for p, m in c.data_version.items())
        return (f"| {role} | {c.run_id} | {shown} | {c.status} | {data} | {(c.model_md5 or '')[:12]} | "
                f"{(c.git_commit or '')[:10]} |")

    verdict = {"promoted": "promoted", "rejected": "champion kept", "failed": "run failed, champion kept"}
    return "\n".join([
        f"# {title}: {verdict[challenger.status]}", "",
        f"| | run | {key} | status | data version | model md5 | git commit |",
        "|---|---|---|---|---|---|---|",
        row("champion before", champion), row("challenger", challenger), "",
        f"**decision:** {challenger.reason.replace('|', '/')}", "",
        f"rule: {rule.direction} {key}, min_delta {rule.min_delta:g}",
    ])
