"""reference: `conveyor run --force` of the reference pipeline vs the same work as one plain script.

569 rows, each run in a fresh copy of HEAD's tracked files: on one `prefect server start` (rows 1-2), with its temporary
server (3-4), forked by warm runners (5). Checked: every stage ran (in 5, forked); both wrote every output, the same raw
and processed rows (to 1e-9) and split counts, test AUCs within 0.02; plain imported no orchestrator.
"""
import io
import json
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks import projects
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.processes import PrefectServer, leftovers
from benchmarks.projects import Copies, base_env, check_no_leftovers, cli, commit, no_server_env
from conveyor.cli.warm_state import runners

NAME = "reference"
DESCRIPTION = "conveyor run --force of the reference pipeline vs the same work as one plain script"
PLAIN = Path(__file__).resolve().parent / "plain_reference.py"
STAGES = ("ingest", "preprocess", "train_xgb", "train_mlp", "stack", "evaluate")
WRITTEN = ("models/xgb.json", "models/mlp.pt", "models/stack.json", "metrics/train_xgb.json",
           "metrics/train_mlp.json", "metrics/test.json", "plots/roc.png", "data/processed/stats.json")
AUC_TOLERANCE, ROW_TOLERANCE, MIN_AUC = 0.02, 1e-9, 0.9  # rows: dask's partitioned sums vs pandas' last bits
GOAL = 3.0  # conveyor's wall at most this many times the plain script's


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
    """A copy of the reference project trained by one ``conveyor run`` (not counted): its root and environment."""
    root = scratch / "project"
    make_template(root)
    env = no_server_env(scratch / "prefect-home")
    log(f"{name}: training the reference model (conveyor run, not counted)")
    cli(["conveyor", "run"], root, env)
    leftovers(scratch / "prefect-home", grace_s=0)  # the server and warm runner it kept: what follows needs neither
    return root, env


def one_run(template: Path, copies: Copies, side: str, env: Mapping[str, str], home: Path) -> dict[str, Any]:
    """One run of ``side`` (``plain`` or a conveyor side) in a fresh copy: what it took and wrote, checked."""
    plain = side == "plain"
    with copies.fresh(template, side) as workdir:
        since = time.time()
        command = [sys.executable, str(PLAIN), "out", "--project", "."] if plain else ["conveyor", "run", "--force"]
        runs = env if plain or "CONVEYOR_WARM_IDLE" in env else {**env, "CONVEYOR_WARM": "0"}  # row 5: forked
        done = projects.timed_cli(command, workdir, runs, memory=True)  # the tree's: not a forked run's memory
        outdir = workdir / "out" if plain else workdir
        stale = [p for p in WRITTEN if not (outdir / p).is_file() or (outdir / p).stat().st_mtime < since]
        check(not stale, f"{side}: not written by this run: {stale}")
        empty = [s for s in ("train", "valid", "test") if not any((outdir / "data/processed" / s).glob("*.parquet"))]
        check(not empty, f"{side}: no parquet in data/processed/{empty}")
        stats, rows = json.loads((outdir / "data/processed/stats.json").read_text()), {}
        for folder in ("raw", "processed/train", "processed/valid", "processed/test"):
            values = (frame := pd.read_parquet(outdir / "data" / folder)).to_numpy(dtype=np.float64)
            rows[folder] = [str(c) for c in frame.columns], values[np.lexsort(np.round(values, 9).T[::-1])]  # sorted
        got: dict[str, Any] = {"wall": done.seconds, "peak_mib": done.peak_mib, "rows": rows, "test": json.loads(
            (outdir / "metrics/test.json").read_text()), "stats": {k: stats[k] for k in ("rows", "class_counts",
                                                                                         "features")}}
        if plain:
            timings = json.loads((outdir / "timings.json").read_text())
            check(not timings["forbidden_modules_loaded"], f"plain imported {timings['forbidden_modules_loaded']}")
            return got
        if "PREFECT_API_URL" not in env:
            check_no_leftovers(home, "conveyor run with its temporary Prefect server")
        stages = (record := projects.run_record(workdir))["stages"]
        check(record["status"] == "succeeded" and sorted(stages) == sorted(STAGES) and all(
              s["status"] == "succeeded" and "cache" not in (s.get("reason") or "") for s in stages.values()),
              f"{side}: not every stage ran: { {n: (s['status'], s.get('reason')) for n, s in stages.items()} }")
        return got | {"steps": {name: float(stages[name]["duration_s"]) for name in STAGES}}


def check_same(plain: dict[str, Any], conveyor: dict[str, Any], what: str) -> None:
    """The same stats, raw rows bit for bit, split rows within ROW_TOLERANCE, AUCs within AUC_TOLERANCE."""
    check(plain["stats"] == conveyor["stats"], f"{what}: stats.json differ: {plain['stats']}, {conveyor['stats']}")
    for folder, (cols, rows) in plain["rows"].items():
        other_cols, other = conveyor["rows"][folder]
        check(cols == other_cols and rows.shape == other.shape and np.allclose(
              rows, other, rtol=0, atol=0 if folder == "raw" else ROW_TOLERANCE, equal_nan=True),
              f"{what}: data/{folder}: columns, shape or values differ (tolerance {ROW_TOLERANCE:g}, raw none)")
    aucs = {model: (plain["test"][model]["auc"], conveyor["test"][model]["auc"]) for model in ("xgb", "mlp", "stack")}
    check(all(min(a) >= MIN_AUC and abs(a[0] - a[1]) <= AUC_TOLERANCE for a in aucs.values()),
          f"{what}: test AUC (plain, conveyor) {aucs}: below {MIN_AUC} or more than {AUC_TOLERANCE} apart")


def run(config: Config, log: Callable[[str], None]) -> Result:
    repeats, cold_repeats = config.reps(full=5, quick=2), config.reps(full=3, quick=1)
    with scratch(NAME) as tmp:
        template, copies, home = tmp / "template", Copies(tmp), tmp / "prefect-home"
        make_template(template)
        home.mkdir()

        def side(name: str, env: Mapping[str, str]) -> Callable[[int], dict[str, Any]]:
            return lambda _i: one_run(template, copies, name, env, home)
        plain, cold = side("plain", base_env()), side("conveyor-cold", no_server_env(home))
        with PrefectServer() as server:
            log(f"{NAME}: warm-up (one run of each side on the server up in {server.startup_s:.1f} s, not counted)")
            plain(0), side("warm-up", server.env)(0)
            warm, startup_s = interleaved(repeats, plain, side("conveyor", server.env), log), server.startup_s
            forks = side("conveyor-forked", {**server.env, "CONVEYOR_WARM_IDLE": "600"})
            forks(0), forks(1)  # the runners start, then learn the libraries: not counted
            forked, served = interleaved(repeats, plain, forks, log), sorted(r.served for r in runners(server.home))
            check(served == [repeats + 2, 2 * (repeats + 2)], f"runs, tasks forked by the runners: {served}")
        cold(0)
        cold_runs = interleaved(cold_repeats, plain, cold, log)
    for i, (b, c) in enumerate((pair for runs in (warm, cold_runs, forked) for pair in zip(*runs, strict=True)), 1):
        check_same(b, c, f"repetition {i} (the shared server's, the temporary one's, then the forked ones)")
    metrics = [Metric(label, [o[key] for o in runs[0]], [o[key] for o in runs[1]], digits=digits)
               for label, runs, key, digits in (
                   ("wall (s), conveyor on a shared Prefect server", warm, "wall", 2),
                   ("peak RSS of the process tree (MiB), shared server", warm, "peak_mib", 0),
                   ("wall (s), conveyor starting its temporary Prefect server", cold_runs, "wall", 2),
                   ("peak RSS of the process tree (MiB), temporary server (in the tree)", cold_runs, "peak_mib", 0),
                   ("wall (s), conveyor forked by warm runners, shared server", forked, "wall", 2))]
    share, cold_share = metrics[0].share(), metrics[2].share()
    return Result(
        NAME, DESCRIPTION, "benchmarks/overhead/plain_reference.py: the same work in one process, no orchestrator",
        "`conveyor run --force` of configs/pipeline.yaml (Prefect flow, DVC record, the cpu profile)",
        len(warm[0]), metrics, setup={"prefect server start (rows 1-2)": f"up in {startup_s:.1f} s"},
        notes=[f"goal: conveyor's wall at most {GOAL:g}x the plain script's: {share:.2f}x with the shared server "
               f"({met(share <= GOAL)}), {cold_share:.2f}x with the temporary one ({met(cold_share <= GOAL)})",
               "conveyor's stages (median s, shared server): " + ", ".join(
                   f"{n} {median([o['steps'][n] for o in warm[1]]):.2f}" for n in STAGES)])
