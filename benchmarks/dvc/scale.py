"""scale: what deciding and recording cost as a pipeline grows from 10 to 5,000 stages.

Two hand-written dvc.yaml shapes of trivial ``cmd`` stages (an ``echo`` into the stage's out): a chain
(s<k> reads s<k-1>'s out) and a wide DAG (s00 -> s01..s<n-2> -> s<n-1>, which reads their folder). Decide
time: each project is made up to date without running its commands (the outs written as the commands
would, dvc.lock generated in DVC's format with conveyor's hasher; `dvc status` saying it is up to date
checks that record); then, interleaved, `dvc status` (baseline) against `conveyor status`, a no-op
`conveyor run` (its record: every stage skipped), `validate`, `dag`, `runs`, `compare` and `status` with
nothing kept (``CONVEYOR_SNAPSHOT=0``: reported, not held to the goals), PREFECT_API_URL unset. Goals
(issue 34): each <= 2 s at 5,000 stages, `status` <= 0.5x `dvc status` at 1,000. Recording: a forced run of
an n-stage chain on a `prefect server start` started here; the per-stage cost of the last hundred stages
(from the record's finish times) within 1.5x the first hundred's.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path

import yaml

from benchmarks.dvc import dvc_status
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import check_record, cli, make_repo, no_server_env, run_record, server_env, timed_cli

NAME = "scale"
DESCRIPTION = ("decide time (status, no-op run, validate, dag, runs, compare) of 10 to 5,000-stage dvc.yaml chains "
               "and wide DAGs beside dvc status; per-stage recording cost of a forced run of 2,000 stages")
COLD = "status, nothing kept"  # reported beside the goals, not held to them
GOAL_S = 2.0  # every read-only command and a no-op run at 5,000 stages
GOAL_VS_DVC = 0.5  # at 1,000 stages, conveyor status within this many times dvc status
RECORD_GOAL = 1.5  # the last hundred stages' per-stage cost within this many times the first hundred's
PLOT = REPO / "docs" / "img" / "scale.png"  # the curve the README and the docs show, drawn by each full run
ROW = re.compile(r"^(chain|wide) (\d+): `conveyor ([^`]+)` vs `dvc status` \(s\)$")
Stages = dict[str, tuple[list[str], str]]  # stage -> (deps, out)


def stages_of(shape: str, n: int) -> Stages:
    """The deps and out of each stage of a ``chain`` or a ``wide`` DAG of ``n`` stages."""
    if shape == "chain":
        return {f"s{k:02d}": ([f"out/s{k - 1:02d}.txt"] if k else [], f"out/s{k:02d}.txt") for k in range(n)}
    stages: Stages = {"s00": ([], "out/s00.txt")}
    stages.update({f"s{k:02d}": (["out/s00.txt"], f"out/w/s{k:02d}.txt") for k in range(1, n - 1)})
    if n > 1:
        stages[f"s{n - 1:02d}"] = (["out/w"] if n > 2 else ["out/s00.txt"], f"out/s{n - 1:02d}.txt")
    return stages


def make_project(root: Path, shape: str, n: int, *, fresh: bool = False) -> list[str]:
    """A git + DVC repository with the ``shape`` dvc.yaml of ``n`` stages, up to date unless ``fresh``: the outs as
    each command writes them, in DVC's cache as `dvc commit` leaves them, and dvc.lock recording them."""
    from conveyor.plan.fingerprint import Hasher

    stages = stages_of(shape, n)
    cmd = {s: f"mkdir -p {Path(out).parent} && echo {s} > {out}" for s, (_, out) in stages.items()}
    make_repo(root, {"dvc.yaml": yaml.safe_dump({"stages": {s: {"cmd": cmd[s], **({"deps": deps} if deps else {}),
                     "outs": [out]} for s, (deps, out) in stages.items()}}, sort_keys=False), ".gitignore": "/out\n"},
              dvc=True)
    if fresh:
        return list(stages)
    for s, (_, out) in stages.items():
        (root / out).parent.mkdir(parents=True, exist_ok=True)
        (root / out).write_text(f"{s}\n")
    hasher = Hasher()

    def entries(paths: list[str]) -> list[dict[str, object]]:
        found = [(p, hasher.entry(root, p)) for p in paths]
        check(all(e is not None for _, e in found), f"missing among {paths}")
        return [{"path": p, "hash": "md5", "md5": e.md5, "size": e.size,
                 **({"nfiles": e.nfiles} if e.nfiles is not None else {})} for p, e in found if e is not None]

    lock: dict[str, object] = {}
    for s, (deps, out) in stages.items():
        outs = entries([out])
        md5 = str(outs[0]["md5"])
        (root / ".dvc/cache/files/md5" / md5[:2]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / out, root / ".dvc/cache/files/md5" / md5[:2] / md5[2:])
        lock[s] = {"cmd": cmd[s], **({"deps": entries(deps)} if deps else {}), "outs": outs}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock}, sort_keys=False))
    return list(stages)


def decide(scratch: Path, shape: str, n: int, repeats: int, log: Callable[[str], None]) -> list[Metric]:
    root, env = scratch / f"{shape}-{n}", no_server_env(scratch / "prefect-home")
    stages = make_project(root, shape, n)

    def conveyor(*args: str, **extra: str) -> float:
        seconds = timed_cli(["conveyor", *args], root, {**env, **extra}).seconds
        if args == ("run",):
            check_record(run_record(root), stages, "skipped", f"{root.name}: the no-op run")
        return seconds

    commands: dict[str, Callable[[], float]] = {
        "status": lambda: conveyor("status"), "no-op run": lambda: conveyor("run"),
        **{k: partial(conveyor, k) for k in ("validate", "dag", "runs", "compare")},
        COLD: lambda: conveyor("status", CONVEYOR_SNAPSHOT="0"),  # the first command after a change
    }
    log(f"{NAME}: {shape} of {n}: made up to date; warm-up (not counted)")
    dvc_status(root, env, "before the repetitions")
    conveyor("run")
    base, cand = interleaved(repeats, lambda _i: dvc_status(root, env, "between repetitions", timed=True),
                             lambda _i: {k: fn() for k, fn in commands.items()}, log)
    return [Metric(f"{shape} {n}: `conveyor {k}` vs `dvc status` (s)", list(base), [c[k] for c in cand])
            for k in commands]


def recording(scratch: Path, n: int, server: PrefectServer, log: Callable[[str], None]) -> tuple[float, float]:
    """Seconds per stage of the first and the last hundred stages of a forced run of an n-stage chain."""
    root = scratch / f"record-{n}"
    stages = make_project(root, "chain", n, fresh=True)
    log(f"{NAME}: forced run of a {n}-stage chain (dvc.lock the record)")
    cli(["conveyor", "run", "--force"], root, server_env(server), timeout=7200)
    record = run_record(root)
    check_record(record, stages, "succeeded", f"{root.name}: the forced run")
    dvc_status(root, no_server_env(scratch / "prefect-home"), "after the forced run")
    finished = sorted(datetime.fromisoformat(s["finished"]).timestamp() for s in record["stages"].values())
    k = min(100, n // 2)
    return (finished[k] - finished[0]) / k, (finished[-1] - finished[-1 - k]) / k


def run(config: Config, log: Callable[[str], None]) -> Result:
    sizes = [10, 100, 1000] if config.quick else [10, 100, 1000, 5000]
    record_n, repeats = 200 if config.quick else 2000, config.reps(full=5, quick=2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-scale-"))
    (scratch / "prefect-home").mkdir()
    try:
        metrics = [m for shape in ("chain", "wide") for n in sizes for m in decide(scratch, shape, n, repeats, log)]
        with PrefectServer() as server:
            first, last = recording(scratch, record_n, server, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    big = max(sizes)
    worst = max(median(m.candidate) for m in metrics if m.label.startswith((f"chain {big}:", f"wide {big}:"))
                and COLD not in m.label)
    share = next(median(m.candidate) / median(m.baseline) for m in metrics
                 if m.label.startswith("chain 1000: `conveyor status`"))
    notes = [f"slowest conveyor command at {big} stages: median {worst:.2f} s (goal <= {GOAL_S:g} s at 5,000: "
             f"{met(worst <= GOAL_S)})",
             f"`conveyor status` / `dvc status` at 1,000 stages (chain): {share:.2f}x (goal <= {GOAL_VS_DVC:g}x: "
             f"{met(share <= GOAL_VS_DVC)})",
             f"recording: {first:.3f} s per stage over the first hundred, {last:.3f} s over the last hundred of "
             f"{record_n}: {last / first:.2f}x (goal <= {RECORD_GOAL:g}x: {met(last / first <= RECORD_GOAL)})"]
    metrics.append(Metric(f"forced {record_n}-stage chain: s per stage, first 100 (baseline) vs last 100",
                          [first], [last], digits=3))
    if not config.quick:
        plot({m.label: (median(m.baseline), median(m.candidate)) for m in metrics}, PLOT)
        notes.append(f"plot: {PLOT.relative_to(REPO)}")
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="`dvc status` in the same up-to-date project (recording: the first hundred stages)",
        candidate="the conveyor command named in the row, PREFECT_API_URL unset (recording: the last hundred)",
        repeats=repeats, metrics=metrics,
        setup={"shapes": "chain s00 -> ... and wide s00 -> (s01..s<n-2>) -> s<n-1>, cmd stages that echo their "
                         "name into their out; git init, dvc init, one commit",
               "up to date": "outs written as the commands write them and dvc.lock generated from their hashes "
                             "(conveyor's hasher, DVC's format)",
               "recording": f"`conveyor run --force` of a fresh {record_n}-stage chain against a `prefect server "
                            "start` started here; per-stage cost from the run record's finish times"},
        checks=["`dvc status` said the pipeline is up to date before and between the repetitions",
                "every conveyor command exited 0; every no-op run's record says every stage skipped",
                "after the forced run every stage succeeded and `dvc status` is clean"],
        notes=notes,
    )


def plot(medians: dict[str, tuple[float, float]], path: Path) -> None:
    """Decide time against stages, a panel per shape: `dvc status` and each conveyor command (medians, log-log),
    the 2 s goal across. ``medians``: metric label -> (baseline, candidate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, shape in zip(axes, ("chain", "wide"), strict=True):
        lines: dict[str, dict[int, float]] = {}
        for label, (base, cand) in medians.items():
            if (m := ROW.match(label)) and m[1] == shape:
                lines.setdefault("dvc status", {})[int(m[2])] = base
                lines.setdefault(f"conveyor {m[3]}", {})[int(m[2])] = cand
        for name, points in lines.items():
            dvc = name == "dvc status"
            ax.plot(sorted(points), [points[x] for x in sorted(points)], marker="o", label=name,
                    linestyle="--" if dvc else "-", color="black" if dvc else None)
        ax.axhline(GOAL_S, color="red", linewidth=0.8, linestyle=":", label=f"goal at 5,000: {GOAL_S:g} s")
        ax.set(xscale="log", yscale="log", title=f"{shape} dvc.yaml", xlabel="stages")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,g}"))
        ax.grid(True, which="both", linewidth=0.3)
    axes[0].set_ylabel("seconds (median), up to date")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
