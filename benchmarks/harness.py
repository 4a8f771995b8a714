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
PACKAGES = ("conveyor", "prefect", "dask", "distributed", "pandas", "numpy", "pyarrow", "fsspec", "aiohttp", "dvc")


class CheckFailed(AssertionError):
    """The baseline and the candidate did not produce the same result: no ratio is reported."""


def check(condition: bool, message: str) -> None:
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
    """One quantity, a value per repetition and side; ``ratio`` above 1 means "the candidate is better"."""

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
    """What one benchmark reports (``seconds``, ``load``, ``pressure`` and ``about`` are filled in by ``__main__``)."""

    name: str
    description: str
    baseline: str  # what the baseline is, in words
    candidate: str
    repeats: int
    metrics: list[Metric]
    setup: dict[str, str] = field(default_factory=dict)  # what was measured or chosen at run time
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None  # loadavg before/after
    pressure: tuple[str, str] | None = None  # CPU pressure (PSI) before/after, where the kernel reports it
    about: str = ""  # the benchmark module's docstring: how it measures and what it checks


def interleaved(repeats: int, baseline: Callable[[int], T], candidate: Callable[[int], U],
                log: Callable[[str], None] = lambda _line: None) -> tuple[list[T], list[U]]:
    """``repeats`` runs of each side, B C, then C B...: a drift of the machine's load hits both sides alike."""
    base: list[T] = []
    cand: list[U] = []
    for i in range(repeats):
        for side in ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline"):
            if side == "baseline":
                base.append(baseline(i))
            else:
                cand.append(candidate(i))
            log(f"  repetition {i + 1}/{repeats} {side}: done")
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


def table(result: Result) -> str:
    """Per metric: the medians of both sides, the median of the per-repetition ratios and their min/max."""
    header = ("benchmark", "metric", "baseline (median)", "candidate (median)", "ratio (median)", "ratio min/max", "N")
    rows = [header]
    for m in result.metrics:
        ratios = m.ratios()
        rows.append((result.name, m.label, f"{median(m.baseline):.{m.digits}f}", f"{median(m.candidate):.{m.digits}f}",
                     f"{median(ratios):.2f}x", f"{min(ratios):.2f}x / {max(ratios):.2f}x", str(len(ratios))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(result: Result, machine: str) -> str:
    """The whole text of a result file."""
    r = result
    parts = [f"# {r.name}: {r.description}", "", f"baseline:  {r.baseline}", f"candidate: {r.candidate}",
             f"repetitions: {r.repeats}, interleaved (B C, C B, ...); ratio > 1 means the candidate is better", "",
             table(r), "", "setup:", *(f"  {key}: {value}" for key, value in r.setup.items())]
    if r.checks:
        parts += ["checked before reporting:", *(f"  - {line}" for line in r.checks)]
    if r.notes:
        parts += ["notes:", *(f"  - {line}" for line in r.notes)]
    if r.about:
        parts += ["how (the benchmark's docstring):", *(f"  {line}".rstrip() for line in r.about.splitlines())]
    parts.append("per repetition:")
    for m in r.metrics:
        values = {side: ", ".join(f"{v:.{m.digits}f}" for v in getattr(m, side)) for side in ("baseline", "candidate")}
        parts.append(f"  {m.label}:\n    baseline  [{values['baseline']}]\n    candidate [{values['candidate']}]\n"
                     f"    ratio ({m.ratio}) [{', '.join(f'{x:.2f}' for x in m.ratios())}]")
    if r.load is not None:
        parts.append("load average (1/5/15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
            *r.load[0], *r.load[1]))
    if r.pressure is not None:
        parts.append(f"CPU pressure (/proc/pressure/cpu, share of time some task waited for a CPU) before: "
                     f"{r.pressure[0]}, after: {r.pressure[1]}")
    return "\n".join([*parts, f"benchmark took {r.seconds:.0f} s", "", "machine:", machine, ""])


def write_result(result: Result, machine: str, *, quick: bool) -> Path:
    """``benchmarks/results/<name>-<date>.txt`` (``-quick`` for ``--quick`` runs); overwrites that day's."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{result.name}-{datetime.now(UTC):%Y-%m-%d}{'-quick' if quick else ''}.txt"
    path.write_text(report(result, machine), encoding="utf-8")
    return path


def cpu_pressure() -> str:
    """``avg10=.. avg60=..`` of the kernel's CPU pressure (how contended the cores are), or "n/a"."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "n/a"
    fields = dict(item.split("=", 1) for item in line.split()[1:])
    return f"avg10 {fields.get('avg10', '?')}%, avg60 {fields.get('avg60', '?')}%"


def _git(*args: str) -> str | None:
    """A read-only git query's output in the repository; None where it fails (no git, not a clone)."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine() -> str:
    """The machine and software the numbers were taken on."""
    import psutil

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or "unknown")
    head = _git("rev-parse", "--short", "HEAD")
    dirty = head is not None and _git("diff-index", "--quiet", "HEAD", "--") is None
    return "\n".join([
        f"  cpu: {cpu}; {os.cpu_count()} logical cores ({len(os.sched_getaffinity(0))} usable by this process)",
        f"  memory: {psutil.virtual_memory().total / 2**30:.1f} GiB",
        f"  os: {platform.platform()}",
        f"  python: {sys.version.split()[0]} ({platform.python_implementation()}) at {sys.executable}",
        f"  packages: {', '.join(f'{name} {version(name)}' for name in PACKAGES)}",
        f"  conveyor revision: {head or 'unknown'}{' (with uncommitted changes)' if dirty else ''}",
        f"  taken: {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC",
    ])
