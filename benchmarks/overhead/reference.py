"""reference: `conveyor run --force` of the reference pipeline vs the same work as one plain script.

What the orchestrator costs on the project it ships with (569 rows: almost all fixed cost). Each run is in a
fresh copy of the tracked files at HEAD, timed by hyperfine, its process tree's peak RSS summed by psutil.
Candidate: ``conveyor run --force`` on one `prefect server start` (rows 1-2), then starting Prefect's
temporary server itself (rows 3-4); baseline: ``plain_reference.py``, the same work in one process. Checked:
every stage ran; both wrote every output, the same raw and processed rows (to 1e-9) and split counts, test
AUCs within 0.02 (113 rows: ~60 of 2,982 pairs); the plain script imported no conveyor, prefect, dask.
Goal: conveyor's wall at most 3x the plain script's.
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

from benchmarks import projects
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met
from benchmarks.prefect_server import PrefectServer
from benchmarks.processes import rss_mib, with_prefect_home
from benchmarks.projects import Copies, base_env, check_no_leftovers, cli, commit, conveyor_command, no_server_env

NAME = "reference"
DESCRIPTION = "conveyor run --force of the reference pipeline vs the same work as one plain script"
PLAIN = Path(__file__).resolve().parent / "plain_reference.py"
STAGES = ("ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate")
WRITTEN = ("models/xgb.json", "models/mlp.pt", "models/stack.json", "metrics/train_xgb.json",
           "metrics/train_mlp.json", "metrics/test.json", "plots/roc.png", "data/processed/stats.json")
AUC_TOLERANCE, ROW_TOLERANCE, MIN_AUC = 0.02, 1e-9, 0.9  # rows: dask's partitioned sums vs pandas' last bits
GOAL = 3.0  # conveyor's wall at most this many times the plain script's
Rows = tuple[list[str], npt.NDArray[np.float64]]


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
    """A copy of the reference project trained by one ``conveyor run`` (not counted; Prefect's temporary
    server in a temporary PREFECT_HOME): its root, and the environment to run commands in it."""
    root = scratch / "project"
    make_template(root)
    env = no_server_env(scratch / "prefect-home")
    log(f"{name}: training the reference model (conveyor run, not counted)")
    cli([conveyor_command(), "run"], root, env)
    return root, env


@dataclass
class Outcome:
    """What one run took and left: test metrics, the rows of data/raw and each split (sorted), stats.json."""

    test: dict[str, dict[str, float]]
    rows: dict[str, Rows]
    stats: dict[str, Any]  # rows, class counts, features
    wall: float = 0.0
    peak_mib: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)  # the plain script's steps, conveyor's stages (s)
    record: dict[str, Any] = field(default_factory=dict)  # conveyor's run record
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)  # conveyor: before, in and after the flow (s)


def one_run(template: Path, copies: Copies, side: str, env: Mapping[str, str]) -> Outcome:
    """One run of ``side`` (``plain`` or a conveyor side) in a fresh copy; its outputs, all written by it."""
    plain = side == "plain"
    with copies.fresh(template, side) as workdir:
        since, began = time.time(), datetime.now(UTC)
        # conveyor: the memory measured is the command's process tree; a run forked by a warm runner is not in it
        done = projects.timed_cli([sys.executable, str(PLAIN), "out", "--project", "."] if plain
                                  else [conveyor_command(), "run", "--force"], workdir,
                                  env if plain else {**env, "CONVEYOR_WARM": "0"}, memory=True)
        outdir = workdir / "out" if plain else workdir
        stale = [p for p in WRITTEN if not (outdir / p).is_file() or (outdir / p).stat().st_mtime < since]
        check(not stale, f"{side}: not written by this run: {stale}")
        empty = [s for s in ("train", "valid", "test") if not any((outdir / "data/processed" / s).glob("*.parquet"))]
        check(not empty, f"{side}: no parquet in data/processed/{empty}")
        stats, rows = json.loads((outdir / "data/processed/stats.json").read_text()), dict[str, Rows]()
        for folder in ("raw", "processed/train", "processed/valid", "processed/test"):
            frame = pd.read_parquet(outdir / "data" / folder)  # rows sorted on values rounded to 9 places
            values = frame.to_numpy(dtype=np.float64)
            rows[folder] = [str(c) for c in frame.columns], values[np.lexsort(np.round(values, 9).T[::-1])]
        got = Outcome(json.loads((outdir / "metrics/test.json").read_text()), rows,
                      {k: stats[k] for k in ("rows", "class_counts", "features")}, done.seconds, done.peak_mib)
        if plain:
            timings = json.loads((outdir / "timings.json").read_text())
            check(not timings["forbidden_modules_loaded"], f"plain imported {timings['forbidden_modules_loaded']}")
            got.steps = dict(timings["steps_s"])
            return got
        got.record = record = projects.run_record(workdir)
        stages = record["stages"]
        check(record["status"] == "succeeded" and sorted(stages) == sorted(STAGES) and all(
              s["status"] == "succeeded" and "cache" not in (s.get("reason") or "") for s in stages.values()),
              f"{side}: not every stage ran: { {n: (s['status'], s.get('reason')) for n, s in stages.items()} }")
        got.steps = {name: float(stages[name]["duration_s"]) for name in STAGES}
        got.phases = projects.phases(record, began, done.seconds)
        return got


def check_same(plain: Outcome, conveyor: Outcome, what: str) -> tuple[float, float]:
    """The same stats, the same raw rows bit for bit, split rows within ROW_TOLERANCE, AUCs within AUC_TOLERANCE.
    Returns (max |row diff|, max |AUC diff|)."""
    check(plain.stats == conveyor.stats, f"{what}: stats.json differ: plain {plain.stats}, conveyor {conveyor.stats}")
    worst = 0.0
    for folder, (p_cols, p_rows) in plain.rows.items():
        c_cols, c_rows = conveyor.rows[folder]
        check(p_cols == c_cols and p_rows.shape == c_rows.shape, f"{what}: data/{folder}: columns or shape differ "
                                                                 f"({p_rows.shape} plain, {c_rows.shape} conveyor)")
        diff = float(np.nanmax(np.abs(p_rows - c_rows))) if p_rows.size else 0.0
        check(diff <= (0.0 if folder == "raw" else ROW_TOLERANCE) and bool((np.isnan(p_rows) == np.isnan(c_rows))
                                                                          .all()),
              f"{what}: data/{folder} values differ by up to {diff:g} (tolerance {ROW_TOLERANCE:g}, raw none)")
        worst = max(worst, diff)
    aucs = {model: (plain.test[model]["auc"], conveyor.test[model]["auc"]) for model in ("xgb", "mlp", "stack")}
    check(all(min(a) >= MIN_AUC and abs(a[0] - a[1]) <= AUC_TOLERANCE for a in aucs.values()),
          f"{what}: test AUC (plain, conveyor) {aucs}: below {MIN_AUC} or more than {AUC_TOLERANCE} apart")
    return worst, max(abs(p - c) for p, c in aucs.values())


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats, cold_repeats = config.reps(full=5, quick=2), config.reps(full=3, quick=1)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-reference-"))
    template, copies, cold_home = scratch / "template", Copies(scratch), scratch / "prefect-home"
    try:
        make_template(template)
        cold_home.mkdir()

        def side(name: str, env: Mapping[str, str]) -> Callable[[int], Outcome]:
            return lambda _i: one_run(template, copies, name, env)

        def cold(_i: int) -> Outcome:
            outcome = one_run(template, copies, "conveyor-cold", no_server_env(cold_home))
            check_no_leftovers(cold_home, "conveyor run with its temporary Prefect server")
            return outcome

        log(f"{NAME}: starting prefect server")
        with PrefectServer() as server:
            log(f"{NAME}: warm-up (one run of each side on the server up in {server.startup_s:.1f} s, not counted)")
            side("plain", base_env())(0)
            side("warm-up", server.env)(0)
            log(f"{NAME}: {repeats} interleaved repetitions, conveyor on the shared server")
            warm = interleaved(repeats, side("plain", base_env()), side("conveyor", server.env), log)
            startup_s, server_mib = server.startup_s, rss_mib(with_prefect_home(server.home))
        log(f"{NAME}: cold: one conveyor run with its temporary server to create its database, not counted")
        cold(0)
        log(f"{NAME}: {cold_repeats} interleaved repetitions, conveyor with its temporary server")
        cold_runs = interleaved(cold_repeats, side("plain", base_env()), cold, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    agree = [check_same(b, c, f"{what} server, repetition {i}") for what, (base, cand) in
             (("shared", warm), ("temporary", cold_runs)) for i, (b, c) in enumerate(zip(base, cand, strict=True), 1)]
    base, cand = warm
    metrics = [Metric(label, [getattr(o, key) for o in runs[0]], [getattr(o, key) for o in runs[1]], digits=digits)
               for label, runs, key, digits in (
                   ("wall (s), conveyor on a shared Prefect server", warm, "wall", 2),
                   ("peak RSS of the process tree (MiB), shared server", warm, "peak_mib", 0),
                   ("wall (s), conveyor starting its temporary Prefect server", cold_runs, "wall", 2),
                   ("peak RSS of the process tree (MiB), temporary server (in the tree)", cold_runs, "peak_mib", 0))]
    share, cold_share = metrics[0].share(), metrics[2].share()
    before, flow, after = (median([o.phases[k] for o in cand]) for k in range(3))
    c_before, c_flow, c_after = (median([o.phases[k] for o in cold_runs[1]]) for k in range(3))
    rec = {key: median([float(o.record[key]) for o in cand]) for key in ("critical_path_s", "stage_sum_s")}
    stages, p = cand[0].record["stages"], cand[0].test

    def gaps(record: Mapping[str, Any]) -> float:
        """Seconds of the flow when no stage ran."""
        started, finished = (datetime.fromisoformat(record[k]) for k in ("started", "finished"))
        covered, end = 0.0, started
        for start, stop in sorted((datetime.fromisoformat(s["started"]), datetime.fromisoformat(s["finished"]))
                                  for s in record["stages"].values()):
            if stop > end:
                covered, end = covered + (stop - max(start, end)).total_seconds(), stop
        return (finished - started).total_seconds() - covered

    def steps(runs: list[Outcome]) -> str:
        return ", ".join(f"{n} {median([o.steps[n] for o in runs]):.2f}" for n in runs[0].steps)

    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="benchmarks/overhead/plain_reference.py: the same work in one process, no orchestrator (pandas, "
                 "xgb.train nthread=2, the same MLP, stack, metrics)",
        candidate="`conveyor run --force` of configs/pipeline.yaml (Prefect flow, DVC record; the cpu profile's "
                  "in_process_below places preprocess and XGBoost)",
        repeats=len(base), metrics=metrics,
        setup={"data": f"{cand[0].rows['raw'][1].shape[0]} rows; splits {cand[0].stats['rows']}",
               "prefect server start (rows 1-2)": f"up in {startup_s:.1f} s before the first measurement",
               "repetitions with the temporary server (rows 3-4)": str(len(cold_runs[0]))},
        checks=["every run exited 0, nothing of it left 10 s later; every stage of conveyor's ran (none restored)",
                f"both sides wrote {', '.join(WRITTEN)}; the same data/raw rows bit for bit",
                f"data/processed: the same columns, row counts, stats.json counts and rows (sorted) within "
                f"{ROW_TOLERANCE:g}; largest difference seen {max(a[0] for a in agree):.2g}",
                f"every test AUC >= {MIN_AUC} and within {AUC_TOLERANCE} of the other side's; largest difference "
                f"seen {max(a[1] for a in agree):.4f}", "the plain script imported no conveyor, prefect, dask"],
        notes=[f"goal: conveyor's wall at most {GOAL:g}x the plain script's (ratio column >= {1 / GOAL:.2f}x); "
               f"conveyor / plain (medians of per-repetition quotients): {share:.2f}x with the shared server "
               f"({met(share <= GOAL)}), {cold_share:.2f}x with the temporary one ({met(cold_share <= GOAL)})",
               "where conveyor's stages ran (run record, repetition 1): " + ", ".join(
                   f"{n} ({s['profile']}, {(s.get('placement') or 'on its profile').split(':')[0]})"
                   for n, s in stages.items()),
               f"test AUC (conveyor, repetition 1): xgb {p['xgb']['auc']}, mlp {p['mlp']['auc']}, stack "
               f"{p['stack']['auc']}",
               f"conveyor's time (medians, shared server, run record): {before:.2f} s before the flow, {flow:.2f} s "
               f"in it ({median([gaps(o.record) for o in cand]):.2f} s with no stage running), {after:.2f} s after; "
               f"critical path {rec['critical_path_s']:.2f} s, sum of stages {rec['stage_sum_s']:.2f} s",
               f"conveyor's stages (median s, shared server): {steps(cand)}; the plain script's steps: {steps(base)}",
               f"with the temporary server: {c_before:.2f} s before the flow, {c_flow:.2f} s in it, {c_after:.2f} s "
               f"after it (medians)",
               f"the shared Prefect server's own process tree held {server_mib:.0f} MiB RSS at the end (not in row 2)"],
    )
