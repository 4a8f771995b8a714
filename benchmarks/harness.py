"""What every benchmark shares: interleaved repetitions, ratios, the table, the machine, result files."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")
U = TypeVar("U")

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("conveyor", "prefect", "dask", "distributed", "pandas", "numpy", "pyarrow", "fsspec", "aiohttp",
            "dvc")


class CheckFailed(AssertionError):
    """The baseline and the candidate did not produce the same result: no ratio is reported."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


def rows_label(n: int) -> str:
    """``100k``, ``1M``, ``2.5M``: a row count as a metric's label says it."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def side_command(module: str, *args: str) -> list[str]:
    """``python -c`` running ``module``'s ``side_main(args)``: one side of a benchmark, in a fresh process."""
    return [sys.executable, "-c", f"import sys; from {module} import side_main; sys.exit(side_main(sys.argv[1:]))",
            *args]


def side_report(stdout: str, side: str) -> dict[str, Any]:
    """The JSON line a side's process printed last (its report)."""
    lines = stdout.strip().splitlines()
    check(bool(lines), f"{side}: printed nothing")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


@dataclass(frozen=True)
class Config:
    """How hard to run: repetitions and whether to use the small (``--quick``) sizes."""

    quick: bool
    repeats: int | None = None  # None: the benchmark's own default for the mode

    def reps(self, full: int, quick: int) -> int:
        return self.repeats if self.repeats is not None else (quick if self.quick else full)


@dataclass
class Metric:
    """One measured quantity, one value per repetition on each side.

    ``ratio`` says which way round the ratio is taken so that above 1 means "the candidate
    is better": ``baseline/candidate`` for times, ``candidate/baseline`` for rates.
    """

    label: str
    baseline: list[float] = field(default_factory=list)
    candidate: list[float] = field(default_factory=list)
    ratio: Literal["baseline/candidate", "candidate/baseline"] = "baseline/candidate"
    digits: int = 2

    def ratios(self) -> list[float]:
        pairs = zip(self.baseline, self.candidate, strict=True)
        if self.ratio == "baseline/candidate":
            return [b / c if c else float("nan") for b, c in pairs]
        return [c / b if b else float("nan") for b, c in pairs]

    def share(self) -> float:
        """Median over repetitions of candidate / baseline: how many times the peer's figure conveyor's is."""
        return median([c / b for b, c in zip(self.baseline, self.candidate, strict=True)])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


@dataclass
class Result:
    """What one benchmark reports."""

    name: str
    description: str
    baseline: str  # what the baseline is, in words
    candidate: str
    repeats: int
    metrics: list[Metric]
    setup: dict[str, str] = field(default_factory=dict)  # sizes and knobs, for the record
    checks: list[str] = field(default_factory=list)  # what was verified before reporting
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None  # loadavg before/after
    pressure: tuple[str, str] | None = None  # CPU pressure (PSI) before/after, where the kernel reports it
    about: str = ""  # the benchmark module's docstring: how it measures and what it checks


def interleaved(repeats: int, baseline: Callable[[int], T], candidate: Callable[[int], U],
                log: Callable[[str], None] = lambda _line: None) -> tuple[list[T], list[U]]:
    """``repeats`` runs of each side, interleaved: B C, then C B, then B C... so that a drift
    of the machine's load over time hits both sides alike. Each callable gets the repetition."""
    base: list[T] = []
    cand: list[U] = []

    def run_baseline(i: int) -> None:
        base.append(baseline(i))
        log(f"  repetition {i + 1}/{repeats} baseline: done")

    def run_candidate(i: int) -> None:
        cand.append(candidate(i))
        log(f"  repetition {i + 1}/{repeats} candidate: done")

    for i in range(repeats):
        for step in (run_baseline, run_candidate) if i % 2 == 0 else (run_candidate, run_baseline):
            step(i)
    return base, cand


@contextmanager
def scratch(name: str) -> Iterator[Path]:
    """A temporary folder ``conveyor-bench-<name>-*`` for one benchmark's projects, removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix=f"conveyor-bench-{name}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``fn()`` took (monotonic clock), and what it returned."""
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


# --- the table ------------------------------------------------------------------------


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def table(result: Result) -> str:
    """The result as a fixed-width table: per metric the medians of both sides, the median
    of the per-repetition ratios and their min/max."""
    header = ("benchmark", "metric", "baseline (median)", "candidate (median)", "ratio (median)", "ratio min/max",
              "N")
    rows: list[tuple[str, ...]] = []
    for metric in result.metrics:
        ratios = metric.ratios()
        rows.append((result.name, metric.label, _fmt(statistics.median(metric.baseline), metric.digits),
                     _fmt(statistics.median(metric.candidate), metric.digits),
                     f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}x / {max(ratios):.2f}x",
                     str(len(ratios))))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                  strict=True)))
             for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def raw_values(result: Result) -> str:
    """Every repetition's values, in the order they were taken (for a reader who distrusts medians)."""
    lines = []
    for metric in result.metrics:
        base = ", ".join(_fmt(v, metric.digits) for v in metric.baseline)
        cand = ", ".join(_fmt(v, metric.digits) for v in metric.candidate)
        ratios = ", ".join(f"{r:.2f}" for r in metric.ratios())
        lines.append(f"  {metric.label}:\n    baseline  [{base}]\n    candidate [{cand}]\n    ratio ({metric.ratio}) "
                     f"[{ratios}]")
    return "\n".join(lines)


def report(result: Result, machine: str) -> str:
    """The whole text of a result file."""
    parts = [
        f"# {result.name}: {result.description}",
        "",
        f"baseline:  {result.baseline}",
        f"candidate: {result.candidate}",
        f"repetitions: {result.repeats}, interleaved (B C, C B, ...); ratio > 1 means the candidate is better",
        "",
        table(result),
        "",
        "setup:",
        *(f"  {key}: {value}" for key, value in result.setup.items()),
        "checked before reporting:",
        *(f"  - {line}" for line in result.checks),
    ]
    if result.notes:
        parts += ["notes:", *(f"  - {line}" for line in result.notes)]
    if result.about:
        parts += ["how (the benchmark's docstring):", *(f"  {line}".rstrip() for line in result.about.splitlines())]
    parts += ["per repetition:", raw_values(result)]
    if result.load is not None:
        before, after = result.load
        parts.append(f"load average (1/5/15 min) before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, "
                     f"after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    if result.pressure is not None:
        parts.append(f"CPU pressure (/proc/pressure/cpu, share of time some task waited for a CPU) before: "
                     f"{result.pressure[0]}, after: {result.pressure[1]}")
    parts += [f"benchmark took {result.seconds:.0f} s", "", "machine:", machine, ""]
    return "\n".join(parts)


def write_result(result: Result, machine: str, *, quick: bool) -> Path:
    """``benchmarks/results/<name>-<date>.txt`` (``-quick`` for ``--quick`` runs); overwrites that day's."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if quick else ""
    path = RESULTS / f"{result.name}-{datetime.now(UTC):%Y-%m-%d}{suffix}.txt"
    path.write_text(report(result, machine), encoding="utf-8")
    return path


# --- the machine ----------------------------------------------------------------------


def cpu_pressure() -> str:
    """``avg10=.. avg60=..`` of the kernel's CPU pressure (how contended the cores are), or "n/a"."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "n/a"
    fields = dict(item.split("=", 1) for item in line.split()[1:])
    return f"avg10 {fields.get('avg10', '?')}%, avg60 {fields.get('avg60', '?')}%"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    """A read-only git query in the repository; None where git is unavailable."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def _revision() -> str:
    head = _git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0:
        return "unknown"
    dirty = _git("diff-index", "--quiet", "HEAD", "--")
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty is not None and dirty.returncode else "")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    """The machine and software the numbers were taken on."""
    import psutil
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = ", ".join(f"{name} {_version(name)}" for name in PACKAGES)
    return "\n".join([
        f"  cpu: {_cpu_model()}; {os.cpu_count()} logical cores ({affinity} usable by this process)",
        f"  memory: {psutil.virtual_memory().total / 2**30:.1f} GiB",
        f"  os: {platform.platform()}",
        f"  python: {sys.version.split()[0]} ({platform.python_implementation()}) at {sys.executable}",
        f"  packages: {versions}",
        f"  conveyor revision: {_revision()}",
        f"  taken: {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC",
    ])
