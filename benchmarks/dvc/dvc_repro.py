"""dvc-repro: `conveyor run` vs `dvc repro` of the same hand-written dvc.yaml (4 independent branches).

``prepare`` -> ``branch@a..d`` (each sleeping) -> ``join``, each run in a fresh copy. Goal (issue 34): with the server
conveyor keeps, <= 0.8x dvc repro's wall. Checked: every run exits 0, `dvc status` clean, both leave the same outs,
dvc.lock and .gitignore files; conveyor ran every stage (no run cache), min(4, cores) branches at once (4 placed), and
no server outlived its run."""

import itertools
import math
import os
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from benchmarks import projects
from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, interleaved, met, scratch
from benchmarks.processes import PrefectServer, leftovers

NAME = "dvc-repro"
DESCRIPTION = "conveyor run vs dvc repro on the same hand-written dvc.yaml (4 independent branches)"
ITEMS = ("a", "b", "c", "d")
BRANCHES = [f"branch@{item}" for item in ITEMS]
STAGES = ["prepare", *BRANCHES, "join"]
OUTS = ["data/prepared.txt", *(f"out/{item}.txt" for item in ITEMS), "data/joined.txt"]
PLACED = "configs/placed.yaml"  # what a user whose stages wait rather than compute writes beside dvc.yaml
PLACED_SPEC = "dvc: dvc.yaml\nprofiles: {waits: {kind: threads, max_workers: 4}}\nplacement: {branch@*: {on: waits}}\n"
AT_ONCE, GOAL = min(len(ITEMS), os.cpu_count() or 1), 0.8  # conveyor runs as many local stages at once as cores
DVC_YAML = {"stages": {
    "prepare": {"cmd": "mkdir -p data && printf 'prepared for the branches\\n' > data/prepared.txt", "outs": OUTS[:1]},
    "branch": {"foreach": list(ITEMS), "do": {"cmd": "sleep ${sleep_s} && mkdir -p out && (cat data/prepared.txt; "
                                                     "echo ${item}) > out/${item}.txt", "deps": OUTS[:1],
                                              "outs": ["out/${item}.txt"]}},
    "join": {"cmd": "cat out/a.txt out/b.txt out/c.txt out/d.txt > data/joined.txt", "deps": OUTS[1:5],
             "outs": OUTS[5:]}}}
Outcome = tuple[float, dict[str, Any], int]  # a run's wall, what it left, the most branches running at once


def once(copies: projects.Copies, template: Path, side: str, args: list[str], env: Mapping[str, str],
         home: Path | None) -> Outcome:
    with copies.fresh(template, side) as root:
        wall = projects.timed_cli(args, root, env).seconds
        if home is not None:
            projects.check_no_leftovers(home, f"{side} (its embedded Prefect server)")
        dvc_status(root, env, f"after {side}")
        missing = [out for out in OUTS if not (root / out).is_file()]
        check(not missing, f"{root.name}: outs missing after the run: {missing}")
        lock = yaml.safe_load((root / "dvc.lock").read_text())
        check(sorted(lock.get("stages", {})) == sorted(STAGES), f"{root.name}: dvc.lock does not record {STAGES}")
        seen = {**{out: (root / out).read_text() for out in OUTS}, "dvc.lock": lock,
                **{str(p.relative_to(root)): sorted(p.read_text().splitlines()) for p in root.rglob(".gitignore")
                   if not {".git", ".dvc", ".conveyor"} & set(p.relative_to(root).parts)}}
        if args[0] != "conveyor":
            return wall, seen, 0
        record = projects.run_record(root)
        projects.check_record(record, STAGES, "succeeded", f"{side} in {root.name}")
        check(not any("run cache" in (s.get("reason") or "") for s in record["stages"].values()),
              f"{side} in {root.name}: a stage was restored from the run cache")
        events = sorted((datetime.fromisoformat(record["stages"][b][k]), step) for b in BRANCHES
                        for k, step in (("started", 1), ("finished", -1)))
        return wall, seen, max(itertools.accumulate(step for _, step in events))


def run(config: Config, log: Callable[[str], None]) -> Result:
    (sleep_s, cold_n), repeats = (1.0, 1) if config.quick else (3.0, 2), config.reps(full=5, quick=2)
    serial, parallel = len(ITEMS) * sleep_s, math.ceil(len(ITEMS) / AT_ONCE) * sleep_s
    metrics: list[Metric] = []
    with scratch(NAME) as folder, PrefectServer() as server:
        template, copies, cold, kept = folder / "template", projects.Copies(folder), folder / "cold", folder / "kept"
        projects.make_repo(template, {"dvc.yaml": yaml.safe_dump({"vars": [{"sleep_s": sleep_s}], **DVC_YAML},
                                                                  sort_keys=False), PLACED: PLACED_SPEC}, dvc=True)
        for made in (cold, kept):
            made.mkdir()
        shared, run_ = projects.server_env(server), ["conveyor", "run"]

        def side(name: str, args: list[str], env: Mapping[str, str], home: Path | None) -> Callable[[int], Outcome]:
            own = home if home == cold else None  # a server per run: none left after; the kept one is meant to stay
            return lambda _i: once(copies, template, name, args, env, own)
        for what, args, env, home in (
                ("conveyor on a shared Prefect server", run_, shared, None),
                (f"conveyor with the branches on a threads profile ({PLACED}), shared server", [*run_, "-c", PLACED],
                 shared, None),
                ("conveyor starting a Prefect server of its own", run_,
                 {**projects.no_server_env(cold), "CONVEYOR_SERVER_IDLE": "0"}, cold),
                ("no PREFECT_API_URL: the server conveyor keeps", run_, projects.no_server_env(kept), kept)):
            name, n = f"conveyor-{len(metrics)}", cold_n if home == cold else repeats
            if home is not None:
                server.stop()  # the rows with servers of their own run with no shared one
            log(f"{NAME}: {what}: {n} interleaved repetitions")
            if PLACED not in args:  # not counted: warms the server, creates the embedded one's database or the kept one
                side(f"{name}-first", args, env, home)(0)
            base, cand = interleaved(n, side("dvc-repro", ["dvc", "repro"], shared if home is None else
                                             projects.base_env(), None), side(name, args, env, home), log)
            for i, (b, c) in enumerate(zip(base, cand, strict=True), start=1):
                diff = sorted(k for k in {*b[1], *c[1]} if b[1].get(k) != c[1].get(k))
                check(not diff, f"{what}, repetition {i}: dvc repro and conveyor left different {diff}")
            expected, got = len(ITEMS) if PLACED in args else AT_ONCE, sorted({c[2] for c in cand})
            check(got == [expected], f"{what}: conveyor ran {got} branches at once, expected {expected}")
            metrics.append(Metric(f"wall of the command (s), {what}", [b[0] for b in base], [c[0] for c in cand]))
            if len(metrics) == 1:
                metrics.append(Metric(f"wall minus the sleeps it must wait (s): dvc {serial:g} s serial, conveyor "
                                      f"{parallel:g} s ({AT_ONCE} at once)", [b[0] - serial for b in base],
                                      [c[0] - parallel for c in cand]))
        projects.cli(["conveyor", "server", "stop"], template, projects.no_server_env(kept))
        check(not leftovers(kept), "a process of the kept server outlived `conveyor server stop` by 10 s")
    shared_m, less, placed, cold_m, kept_m = metrics
    return Result(
        NAME, DESCRIPTION, "`dvc repro` in a fresh copy of the project (a stage at a time)", "`conveyor run` in "
        "another fresh copy (independent stages at once)", repeats, [shared_m, less, cold_m, placed, kept_m],
        setup={"sleep per branch": f"{sleep_s:g} s", "prefect server start (rows 1, 2, 4)": f"{server.startup_s:.1f} s",
               "repetitions with the embedded server (row 3)": str(cold_n)},
        notes=[f"conveyor wall / dvc repro wall (the inverse of the ratio column): median {shared_m.share():.2f} with "
               f"the shared server, {cold_m.share():.2f} with a server per run, {placed.share():.2f} with the branches "
               f"placed on a threads profile, {kept_m.share():.2f} with the server conveyor keeps (issue 34's goal "
               f"for a project of independent branches, cold: <= {GOAL}: {met(kept_m.share() <= GOAL)})"])
