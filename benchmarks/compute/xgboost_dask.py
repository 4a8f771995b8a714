"""xgboost-dask: ``xgb.train(nthread=2)`` in one process vs xgboost.dask on 2 one-thread workers.

Both sides call ``conveyor.train.xgb.train_xgboost`` (the reference task's library) in a fresh process, with
params.yaml's ``train.xgb``, on the splits the reference ``tasks.preprocess:prepare`` writes (a part per raw
part and split, not timed): without a client vs with a 2-worker LocalCluster's, started before the clock.
The wall is of the training call (reading the splits and the DMatrix included); both sides again at
``PROFILE_ROUNDS`` rounds split the time into a fixed cost and a cost per round. Checked: each side trains the
same model on every repetition, the sides' best valid log-loss within 2 %. The same model on both sides is
reported, not required (xgboost.dask merges each worker's quantile sketch).
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.compute.preprocess_workers import PARAMS, cpu_worker_env
from benchmarks.compute.training import cpu_cluster, make_splits, side_metrics
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met, side_command, timed
from benchmarks.projects import SideRun, run_side

NAME = "xgboost-dask"
DESCRIPTION = "xgboost.dask on 2 Dask workers vs xgb.train(nthread=2) in one process, same rows and params"
ROWS, QUICK_ROWS = 1_000_000, 100_000
LABEL, SEED = str(PARAMS["preprocess"]["label"]), int(PARAMS["seed"])  # the splits' label, the booster's seed
GOAL = 1.15  # the candidate's wall at most this times the baseline's
TOLERANCE = 1e-6  # "the same model": predictions this close
QUALITY = 0.02  # the two models' best valid logloss at most this far apart, relative
PLAIN, DASK = "xgb.train", "xgboost.dask"
PROFILE_ROUNDS = 100  # the profile's short runs: fixed cost and cost per round from two lengths


def booster_params(threads: int | None) -> tuple[dict[str, Any], int, int]:
    """params.yaml's ``train.xgb`` as the reference task sets it (``nthread`` ``threads``), rounds, patience."""
    import yaml

    from tasks.train import xgb_params

    section = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["xgb"]
    params = xgb_params(section, SEED) | ({"nthread": threads} if threads is not None else {})
    return params, int(section["num_boost_round"]), int(section["early_stopping_rounds"])


def side_main(argv: list[str]) -> int:
    """``xgb.train|xgboost.dask PROCESSED PREDICTIONS.npy [ROUNDS]``: train once (ROUNDS: that many, no early
    stopping), print one JSON line."""
    side, processed, predictions = argv[0], Path(argv[1]), Path(argv[2])
    import dask.dataframe as dd
    import numpy as np
    import xgboost as xgb

    from conveyor.train.xgb import train_xgboost

    params, rounds, stop = booster_params(2 if side == PLAIN else None)
    rounds, patience = (int(argv[3]), None) if len(argv) > 3 else (rounds, stop)
    split = {name: dd.read_parquet(str(processed / name)) for name in ("train", "valid")}
    features = [c for c in split["train"].columns if c != LABEL]
    report: dict[str, Any] = {"side": side}
    with ExitStack() as stack:
        client: Any = None
        if side != PLAIN:  # the cluster up, xgboost imported in its workers, before the clock
            client, start = stack.enter_context(cpu_cluster(2))
            report["start"] = start + timed(lambda: client.run(lambda: __import__("xgboost")))[0]
        report["seconds"], trained = timed(lambda: train_xgboost(
            client, params, split["train"], valid=split["valid"], label=LABEL, features=features,
            num_boost_round=rounds, early_stopping_rounds=patience))
    np.save(predictions, trained.booster.predict(xgb.DMatrix(split["valid"].compute()[features])))
    report |= {"best_iteration": trained.best_iteration, "rounds": trained.rounds, "n_workers": trained.n_workers,
               "best_logloss": float(trained.history["valid"]["logloss"][trained.best_iteration])}
    print(json.dumps(report), flush=True)
    return 0


def run(config: Config, log: Callable[[str], None]) -> Result:
    import numpy as np

    rows, repeats = QUICK_ROWS if config.quick else ROWS, config.reps(full=3, quick=1)
    root, counter = Path(tempfile.mkdtemp(prefix="conveyor-bench-xgboost-")), itertools.count()

    def measure(side: str, rounds: int | None, _repetition: int) -> SideRun:
        predictions = root / f"predictions-{next(counter)}.npy"
        done = run_side(side_command(__name__, side, str(root / "processed"), str(predictions),
                                     *([] if rounds is None else [str(rounds)])), side)
        done.report["predictions"] = np.load(predictions)
        return done

    try:
        log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
        splits = make_splits(root, rows, root / "processed", plain=False)
        (base, cand), short = [interleaved(repeats, partial(measure, PLAIN, n), partial(measure, DASK, n), log)
                               for n in (None, PROFILE_ROUNDS)]  # then the profile's: no early stopping
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for side, done in ((PLAIN, base), (DASK, cand)):  # each side is deterministic: the same model every time
        check(all(r.report["best_iteration"] == done[0].report["best_iteration"]
                  and bool(np.array_equal(r.report["predictions"], done[0].report["predictions"])) for r in done),
              f"{side}: repetitions trained different models")
    first, other = base[0].report, cand[0].report
    check(abs(other["best_logloss"] - first["best_logloss"]) <= QUALITY * first["best_logloss"],
          f"xgboost.dask's best valid logloss {other['best_logloss']:.6f} is more than {QUALITY:.0%} from "
          f"xgb.train's {first['best_logloss']:.6f}")
    identical = other["best_iteration"] == first["best_iteration"] and bool(
        np.allclose(other["predictions"], first["predictions"], rtol=TOLERANCE, atol=TOLERANCE))
    rounds = int(first["rounds"])
    check(all(int(r.report["rounds"]) == PROFILE_ROUNDS < rounds for r in short[0] + short[1]),
          f"the profile's runs trained {sorted({r.report['rounds'] for r in short[0] + short[1]})} rounds, the "
          f"others {rounds}: expected {PROFILE_ROUNDS} and more")
    per_round = [(median([r.seconds for r in full]) - median([r.seconds for r in cut])) / (rounds - PROFILE_ROUNDS)
                 for full, cut in ((base, short[0]), (cand, short[1]))]
    fixed = [median([r.seconds for r in cut]) - PROFILE_ROUNDS * each for cut, each in zip(short, per_round,
                                                                                            strict=True)]
    once, each = fixed[1] - fixed[0], per_round[1] - per_round[0]
    wall, whole, peak = side_metrics("", base, cand)
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="conveyor.train.xgb.train_xgboost(None, ...): xgb.train(nthread=2) in one process",
        candidate="train_xgboost(client, ...) on a LocalCluster(n_workers=2, threads_per_worker=1): xgboost.dask",
        repeats=repeats, metrics=[wall, Metric(f"wall of the training call, {PROFILE_ROUNDS} rounds (s)",
                                               [r.seconds for r in short[0]], [r.seconds for r in short[1]]),
                                  whole, peak],
        setup={"data": f"{rows:,} synthetic HIGGS-shaped rows, split by tasks.preprocess:prepare: {splits}",
               "params": json.dumps(booster_params(None)), "cluster": "started before the clock, xgboost imported "
               f"in its workers; the cpu profile's worker_env {json.dumps(cpu_worker_env())}"},
        checks=["each side trained the same model on every repetition (best iteration, valid predictions bit for bit)",
                f"the profile's runs trained {PROFILE_ROUNDS} rounds, the others more",
                f"the two sides' best valid logloss within {QUALITY:.0%} of each other"],
        notes=[f"goal (issue 14): xgboost.dask on 2 workers within {GOAL:g}x of xgb.train(nthread=2); measured "
               f"{wall.share():.2f}x (median of per-repetition quotients): {met(wall.share() <= GOAL)}",
               f"the same model on both sides: {'yes' if identical else 'NO'}; best iteration "
               f"{first['best_iteration']} of {rounds} (valid logloss {first['best_logloss']:.6f}) vs "
               f"{other['best_iteration']} of {other['rounds']} ({other['best_logloss']:.6f}); valid predictions up "
               f"to {float(np.max(np.abs(other['predictions'] - first['predictions']))):.3g} apart; the cluster's "
               f"start and imports {median([r.report['start'] for r in cand]):.2f} s (median, outside the call)",
               f"profile (T = fixed + rounds x per round, medians of the {PROFILE_ROUNDS}- and {rounds}-round runs): "
               f"xgb.train fixed {fixed[0]:.2f} s, {per_round[0] * 1e3:.1f} ms per round; xgboost.dask fixed "
               f"{fixed[1]:.2f} s, {per_round[1] * 1e3:.1f} ms per round: of its {once + rounds * each:+.2f} s at "
               f"{rounds} rounds, {once:+.2f} s paid once and {rounds * each:+.2f} s in the rounds "
               f"({each * 1e3:+.1f} ms each)"],
    )
