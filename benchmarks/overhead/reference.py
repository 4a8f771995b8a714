"""reference: `conveyor run --force` of the reference pipeline vs the same work as one plain script.

The question: what does the orchestrator cost on the project it ships with? The reference
pipeline (``configs/pipeline.yaml``: ingest on a thread pool, preprocess with
dask.dataframe and XGBoost on the ``cpu`` profile, a torch MLP in the runner, a stacked
logistic regression, evaluation) works on scikit-learn's bundled breast-cancer data (569
rows), so almost all of it is fixed cost: interpreter and imports, DVC's status and lock,
Prefect's flow and task runs. The ``cpu`` profile's ``in_process_below: 64MiB`` places the
preprocess and the XGBoost training in conveyor's process for data this small (the run
record's ``placement`` says so; a note lists it), so no Dask worker starts.

- candidate: ``conveyor run --force`` in a fresh copy of the repository's tracked files at
  HEAD (``git archive HEAD``: the project as a fresh clone has it, made a git repository
  with one commit, which DVC needs), with ``PREFECT_API_URL`` pointing at one
  ``prefect server start`` started here before any measurement (a team keeps a server);
  and, as a second figure, with no ``PREFECT_API_URL``, so that every run starts and
  stops Prefect's temporary server itself (its ``PREFECT_HOME`` a temporary folder whose
  database one uncounted run created).
- baseline: ``benchmarks/overhead/plain_reference.py``, the same work in one process with the same
  libraries and no orchestrator (pandas instead of dask.dataframe, ``xgb.train`` with
  ``nthread=2`` instead of xgboost.dask on two one-thread workers, the same MLP, stack and
  metrics), in another fresh copy.

Before any ratio: both exit 0; the run record says every stage ran (none skipped or
restored); both wrote every model, metrics file and the plot; the raw and processed data
hold the same rows (same columns, counts, and values sorted row-wise, equal to 1e-9),
with the same split counts; the test AUC of each model agrees within 0.02 (the test split
is 113 rows, 42 x 71 positive/negative pairs: 0.02 is about 60 pairs ranked the other way,
far more than an XGBoost trained on Dask workers instead of one process could change,
far less than a broken model loses). The plain script imported none of conveyor,
prefect, dask, distributed.

The goal: conveyor's wall at most 3x the plain script's (ratio column at least 0.33x).
On a data set this small the work itself is a few seconds, so that bound is a bound on
the fixed cost. Peak memory is the summed RSS of the command's process tree (the command
and every descendant: Dask's workers where a profile starts them, the temporary Prefect server),
sampled from /proc every 100 ms on both sides; shared pages are counted once per
process, so it overstates what the tree holds, alike for both sides in kind. The shared
server of the first figure is not in conveyor's tree (its RSS at the end is in a note).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median
from benchmarks.prefect_server import PrefectServer
from benchmarks.processes import rss_mib, with_prefect_home
from benchmarks.projects import (
    Copies,
    base_env,
    check_no_leftovers,
    cli,
    commit,
    conveyor_command,
    no_server_env,
    timed_cli,
)

NAME = "reference"
DESCRIPTION = "conveyor run --force of the reference pipeline vs the same work as one plain script"
PLAIN = Path(__file__).resolve().parent / "plain_reference.py"
STAGES = ("ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate")
PLAIN_STEPS = ("imports", "ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate")
MODELS = ("xgb", "mlp", "stack")
SPLITS = ("train", "valid", "test")
WRITTEN = ("models/xgb.json", "models/mlp.pt", "models/stack.json", "metrics/train_xgb.json",
           "metrics/train_mlp.json", "metrics/test.json", "plots/roc.png", "data/processed/stats.json")
AUC_TOLERANCE = 0.02
ROW_TOLERANCE = 1e-9  # standardised values: dask's partitioned sums vs pandas' may differ in the last bits
MIN_AUC = 0.9  # a model that learned nothing scores about 0.5
GOAL = 3.0  # conveyor's wall at most this many times the plain script's


# --- the project copies -------------------------------------------------------------------


def make_template(root: Path) -> None:
    """The repository's tracked files at HEAD, as a fresh clone has them, in a new git repository."""
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], capture_output=True,
                             timeout=120, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    check((root / "configs/pipeline.yaml").is_file() and (root / "params.yaml").is_file(),
          "git archive HEAD holds no configs/pipeline.yaml and params.yaml")
    cli(["git", "init", "-q"], root, base_env())
    commit(root, "reference")


def trained_reference(scratch: Path, log: Callable[[str], None], name: str) -> tuple[Path, dict[str, str]]:
    """A copy of the reference project (:func:`make_template`) trained by one ``conveyor run``
    (not counted; Prefect's temporary server in a temporary PREFECT_HOME): its root, and the
    environment to run commands in it."""
    root = scratch / "project"
    make_template(root)
    env = no_server_env(scratch / "prefect-home")
    log(f"{name}: training the reference model (conveyor run, not counted)")
    cli([conveyor_command(), "run"], root, env)
    return root, env


@dataclass
class Outcome:
    """What one run left behind and took."""

    wall: float
    peak_rss_mib: float
    test: dict[str, dict[str, float]]  # metrics/test.json
    raw: npt.NDArray[np.float64]  # data/raw, rows sorted
    processed: dict[str, tuple[list[str], npt.NDArray[np.float64]]]  # per split: columns, rows sorted
    stats: dict[str, Any]  # data/processed/stats.json: rows and class counts
    steps: dict[str, float] = field(default_factory=dict)  # plain: its steps; conveyor: its stages (s)
    phases: tuple[float, float, float] | None = None  # conveyor: before, in and after the flow (s)
    flow_gaps: float = 0.0  # conveyor: seconds of the flow when no stage ran
    critical_path_s: float = 0.0
    stage_sum_s: float = 0.0
    placement: dict[str, str] = field(default_factory=dict)  # conveyor: stage -> where it ran (run record)


def _sorted_rows(directory: Path) -> tuple[list[str], npt.NDArray[np.float64]]:
    """Columns, and the rows as floats sorted lexicographically (on values rounded to 9 places)."""
    frame = pd.read_parquet(directory)
    values = frame.to_numpy(dtype=np.float64)
    order = np.lexsort(np.round(values, 9).T[::-1])
    return [str(c) for c in frame.columns], values[order]


def _observe(outdir: Path, side: str, since: float) -> Outcome:
    """The outputs of a run in ``outdir``: every file written by this run (mtime after ``since``)."""
    stale = [p for p in WRITTEN if not (outdir / p).is_file() or (outdir / p).stat().st_mtime < since]
    check(not stale, f"{side}: not written by this run: {stale}")
    processed = {}
    for split in SPLITS:
        check(any((outdir / "data/processed" / split).glob("*.parquet")), f"{side}: no parquet in "
                                                                           f"data/processed/{split}")
        processed[split] = _sorted_rows(outdir / "data/processed" / split)
    stats = json.loads((outdir / "data/processed/stats.json").read_text())
    return Outcome(0.0, 0.0, json.loads((outdir / "metrics/test.json").read_text()),
                   _sorted_rows(outdir / "data/raw")[1], processed,
                   {"rows": stats["rows"], "class_counts": stats["class_counts"], "features": stats["features"]})


class Runs:
    """Each run in a fresh copy of the template, timed by hyperfine, its tree's memory sampled by psutil."""

    def __init__(self, template: Path, scratch: Path) -> None:
        self.template, self.copies = template, Copies(scratch)

    def plain(self, env: Mapping[str, str]) -> Outcome:
        with self.copies.fresh(self.template, "plain") as workdir:
            since = time.time()
            done = timed_cli([sys.executable, str(PLAIN), "out", "--project", "."], workdir, env, memory=True)
            outcome = _observe(workdir / "out", "plain", since)
            timings = json.loads((workdir / "out/timings.json").read_text())
            check(not timings["forbidden_modules_loaded"], f"the plain script imported "
                                                           f"{timings['forbidden_modules_loaded']}")
            outcome.wall, outcome.peak_rss_mib, outcome.steps = done.seconds, done.peak_mib, dict(timings["steps_s"])
            return outcome

    def conveyor(self, env: Mapping[str, str], side: str = "conveyor") -> Outcome:
        with self.copies.fresh(self.template, side) as workdir:
            since, began = time.time(), datetime.now(UTC)
            # the memory measured is the command's process tree: a run forked by a warm runner is not in it
            done = timed_cli([conveyor_command(), "run", "--force"], workdir, {**env, "CONVEYOR_WARM": "0"},
                             memory=True)
            outcome = _observe(workdir, side, since)
            _record(workdir, outcome, began, done.seconds)
            outcome.wall, outcome.peak_rss_mib = done.seconds, done.peak_mib
            return outcome


def _record(workdir: Path, outcome: Outcome, began: datetime, wall: float) -> None:
    """From conveyor's run record (checked: every stage ran): stage durations, phases, gaps in the flow."""
    record: dict[str, Any] = json.loads((workdir / ".conveyor/runs/latest.json").read_text())
    stages: dict[str, Any] = record["stages"]
    check(record["status"] == "succeeded" and sorted(stages) == sorted(STAGES)
          and all(s["status"] == "succeeded" and "cache" not in (s.get("reason") or "") for s in stages.values()),
          f"{workdir.name}: not every stage ran: { {n: (s['status'], s.get('reason')) for n, s in stages.items()} }")
    started, finished = datetime.fromisoformat(record["started"]), datetime.fromisoformat(record["finished"])
    before, flow = (started - began).total_seconds(), (finished - started).total_seconds()
    spans = sorted((datetime.fromisoformat(s["started"]), datetime.fromisoformat(s["finished"]))
                   for s in stages.values())
    covered, end = 0.0, started
    for start, stop in spans:
        if stop > end:
            covered += (stop - max(start, end)).total_seconds()
            end = stop
    outcome.steps = {name: float(stages[name]["duration_s"]) for name in STAGES}
    outcome.phases = (before, flow, wall - before - flow)
    outcome.flow_gaps = flow - covered
    outcome.critical_path_s = float(record["critical_path_s"])
    outcome.stage_sum_s = float(record["stage_sum_s"])
    outcome.placement = {name: f"{s['profile']}, {(s.get('placement') or 'on its profile').split(':')[0]}"
                         for name, s in stages.items()}


# --- checks -------------------------------------------------------------------------------


def check_same(plain: Outcome, conveyor: Outcome, what: str) -> tuple[float, float]:
    """Same rows, split counts, outputs; AUCs within AUC_TOLERANCE. Returns (max |row diff|, max |AUC diff|)."""
    check(plain.raw.shape == conveyor.raw.shape, f"{what}: data/raw has {plain.raw.shape} (plain) vs "
                                                 f"{conveyor.raw.shape} (conveyor) rows x columns")
    check(bool(np.array_equal(plain.raw, conveyor.raw, equal_nan=True)), f"{what}: data/raw rows differ")
    check(plain.stats == conveyor.stats, f"{what}: stats.json rows/class counts/features differ: plain "
                                         f"{plain.stats} vs conveyor {conveyor.stats}")
    worst = 0.0
    for split in SPLITS:
        (p_cols, p_rows), (c_cols, c_rows) = plain.processed[split], conveyor.processed[split]
        check(p_cols == c_cols, f"{what}: data/processed/{split} columns differ: {p_cols} vs {c_cols}")
        check(p_rows.shape == c_rows.shape, f"{what}: data/processed/{split} has {p_rows.shape} (plain) vs "
                                            f"{c_rows.shape} (conveyor) rows x columns")
        diff = float(np.nanmax(np.abs(p_rows - c_rows))) if p_rows.size else 0.0
        check(diff <= ROW_TOLERANCE and bool((np.isnan(p_rows) == np.isnan(c_rows)).all()),
              f"{what}: data/processed/{split} values differ by up to {diff:g} (tolerance {ROW_TOLERANCE:g})")
        worst = max(worst, diff)
    auc_diff = 0.0
    for model in MODELS:
        p_auc, c_auc = plain.test[model]["auc"], conveyor.test[model]["auc"]
        check(min(p_auc, c_auc) >= MIN_AUC, f"{what}: {model} test AUC {p_auc} (plain), {c_auc} (conveyor): "
                                            f"below {MIN_AUC}")
        check(abs(p_auc - c_auc) <= AUC_TOLERANCE, f"{what}: {model} test AUC {p_auc} (plain) vs {c_auc} "
                                                   f"(conveyor): more than {AUC_TOLERANCE} apart")
        auc_diff = max(auc_diff, abs(p_auc - c_auc))
    return worst, auc_diff


# --- the benchmark ------------------------------------------------------------------------


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats = config.reps(full=5, quick=2)
    cold_repeats = config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-reference-"))
    runs = Runs(scratch / "template", scratch)
    cold_home = scratch / "prefect-home"
    try:
        make_template(scratch / "template")
        cold_home.mkdir()
        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            log(f"{NAME}: prefect server up in {server.startup_s:.1f} s on {server.url}")
            log(f"{NAME}: warm-up (one run of each side on the server, not counted)")
            runs.plain(base_env())
            runs.conveyor(server.env, "warm-up")
            log(f"{NAME}: {repeats} interleaved repetitions, conveyor on the shared server")
            base, cand = interleaved(repeats, lambda _i: runs.plain(base_env()), lambda _i: runs.conveyor(server.env),
                                     log)
            startup_s, server_mib = server.startup_s, rss_mib(with_prefect_home(server.home))

        def cold(_i: int) -> Outcome:
            outcome = runs.conveyor(no_server_env(cold_home), "conveyor-cold")
            check_no_leftovers(cold_home, "conveyor run with its temporary Prefect server")
            return outcome

        log(f"{NAME}: cold: one conveyor run with its temporary server to create its database, not counted")
        cold(0)
        log(f"{NAME}: {cold_repeats} interleaved repetitions, conveyor with its temporary server")
        cold_base, cold_cand = interleaved(cold_repeats, lambda _i: runs.plain(base_env()), cold, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    agreement = [check_same(b, c, f"shared server, repetition {i}")
                 for i, (b, c) in enumerate(zip(base, cand, strict=True), start=1)]
    agreement += [check_same(b, c, f"temporary server, repetition {i}")
                  for i, (b, c) in enumerate(zip(cold_base, cold_cand, strict=True), start=1)]
    return _result((base, cand), (cold_base, cold_cand), agreement, startup_s, server_mib)


def _result(warm: tuple[list[Outcome], list[Outcome]], cold: tuple[list[Outcome], list[Outcome]],
            agreement: list[tuple[float, float]], startup_s: float, server_mib: float) -> Result:
    base, cand = warm
    wall = Metric("wall (s), conveyor on a shared Prefect server", [o.wall for o in base], [o.wall for o in cand])
    rss = Metric("peak RSS of the process tree (MiB), shared server", [o.peak_rss_mib for o in base],
                 [o.peak_rss_mib for o in cand], digits=0)
    cold_wall = Metric("wall (s), conveyor starting its temporary Prefect server", [o.wall for o in cold[0]],
                       [o.wall for o in cold[1]])
    cold_rss = Metric("peak RSS of the process tree (MiB), temporary server (in the tree)",
                      [o.peak_rss_mib for o in cold[0]], [o.peak_rss_mib for o in cold[1]], digits=0)
    share, cold_share = wall.share(), cold_wall.share()
    before, flow, after = (median([o.phases[k] for o in cand if o.phases]) for k in range(3))
    c_before, c_flow, c_after = (median([o.phases[k] for o in cold[1] if o.phases]) for k in range(3))
    stage_s = {name: median([o.steps[name] for o in cand]) for name in STAGES}
    step_s = {name: median([o.steps[name] for o in base]) for name in PLAIN_STEPS}
    plain_wall = median(wall.baseline)
    p = cand[0].test
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="benchmarks/overhead/plain_reference.py: the same work in one process, no orchestrator (pandas, "
                 "xgb.train nthread=2, the same MLP, stack, metrics)",
        candidate="`conveyor run --force` of configs/pipeline.yaml (Prefect flow, DVC record; the cpu profile's "
                  "in_process_below places preprocess and XGBoost)",
        repeats=len(base), metrics=[wall, rss, cold_wall, cold_rss],
        setup={"data": f"{cand[0].raw.shape[0]} rows; splits {cand[0].stats['rows']}",
               "prefect server start (rows 1-2)": f"up in {startup_s:.1f} s before the first measurement",
               "repetitions with the temporary server (rows 3-4)": str(len(cold[0]))},
        checks=["every run exited 0 and left no process of its group running 10 s later; conveyor's run record "
                "says every stage succeeded, none restored from a cache",
                f"both sides wrote, in this run, {', '.join(WRITTEN)}; data/raw the same rows bit for bit",
                f"data/processed: the same columns, row counts and rows (sorted) within {ROW_TOLERANCE:g}, the same "
                f"stats.json counts; largest difference seen {max(a[0] for a in agreement):.2g}",
                f"every model's test AUC at least {MIN_AUC} on both sides and within {AUC_TOLERANCE} of the other's; "
                f"largest difference seen {max(a[1] for a in agreement):.4f}",
                "the plain script imported none of conveyor, prefect, dask, distributed"],
        notes=[f"goal: conveyor's wall at most {GOAL:g}x the plain script's (ratio column >= {1 / GOAL:.2f}x); "
               f"measured conveyor / plain (medians of per-repetition quotients): {share:.2f}x with the shared "
               f"server ({'met' if share <= GOAL else 'NOT met'}), {cold_share:.2f}x with the temporary one "
               f"({'met' if cold_share <= GOAL else 'NOT met'})",
               "where conveyor's stages ran (run record, repetition 1): "
               + ", ".join(f"{n} ({w})" for n, w in cand[0].placement.items()),
               f"test AUC (conveyor, repetition 1): xgb {p['xgb']['auc']}, mlp {p['mlp']['auc']}, stack "
               f"{p['stack']['auc']}",
               f"where conveyor's {median(wall.candidate):.2f} s go (medians, shared server, from its run record): "
               f"{before:.2f} s before the flow started (interpreter, imports, spec and DVC status, creating the flow "
               f"run), {flow:.2f} s in the flow, {after:.2f} s after it (closing any Dask cluster, the summary, "
               f"Prefect draining at exit); within the flow {median([o.flow_gaps for o in cand]):.2f} s with no "
               f"stage running; critical path {median([o.critical_path_s for o in cand]):.2f} s, sum of stages "
               f"{median([o.stage_sum_s for o in cand]):.2f} s",
               "conveyor's stages (median s, shared server; a stage's time includes importing its task module, DVC "
               "hashing and recording its outs, and starting a Dask cluster where it is the first on one): "
               + ", ".join(f"{n} {s:.2f}" for n, s in stage_s.items()),
               f"the plain script's {plain_wall:.2f} s (median): "
               + ", ".join(f"{n} {s:.2f}" for n, s in step_s.items())
               + " (from its first import; the rest is the interpreter starting)",
               f"with the temporary server (rows 3-4): {c_before:.2f} s before the flow, {c_flow:.2f} s in it, "
               f"{c_after:.2f} s after it (medians): starting and stopping the server on top of the above",
               f"the shared Prefect server's own process tree held {server_mib:.0f} MiB RSS at the end (not in "
               "row 2's conveyor figure)"],
    )
