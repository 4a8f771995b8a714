"""scale: what deciding and recording cost as a pipeline grows from 10 to 5,000 stages.

A chain and a wide DAG of ``echo`` stages, made up to date without running them: `dvc status` against conveyor's
commands (goals, issue 34: each <= 2 s at 5,000, `status` <= 0.5x at 1,000), then a forced chain's last hundred
stages against its first (<= 1.5x). Checked: `dvc status` clean before, between and after, no-op runs skip all."""

import re
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import yaml

from benchmarks.dvc import dvc_status
from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met, scratch
from benchmarks.processes import PrefectServer, leftovers
from benchmarks.projects import check_record, cli, make_repo, no_server_env, run_record, server_env, timed_cli

NAME = "scale"
DESCRIPTION = ("decide time (status, no-op run, validate, dag, runs, compare) of 10 to 5,000-stage dvc.yaml chains "
               "and wide DAGs beside dvc status; per-stage recording cost of a forced run of 2,000 stages")
COLD = "status, nothing kept"  # reported beside the goals, not held to them
COMMANDS = {"status": ("status",), "no-op run": ("run",), **{k: (k,) for k in ("validate", "dag", "runs", "compare")},
            COLD: ("status",)}
GOAL_S, GOAL_VS_DVC, RECORD_GOAL = 2.0, 0.5, 1.5
PLOT = REPO / "docs" / "img" / "scale.png"  # the curve the README and the docs show, drawn by each full run
ROW = re.compile(r"^(chain|wide) (\d+): `conveyor ([^`]+)` vs `dvc status` \(s\)$")


def stages_of(shape: str, n: int) -> dict[str, tuple[list[str], str]]:  # stage: (deps, out)
    if shape == "chain":
        return {f"s{k:02d}": ([f"out/s{k - 1:02d}.txt"] if k else [], f"out/s{k:02d}.txt") for k in range(n)}
    last = {f"s{n - 1:02d}": (["out/w"] if n > 2 else ["out/s00.txt"], f"out/s{n - 1:02d}.txt")} if n > 1 else {}
    wide = {f"s{k:02d}": (["out/s00.txt"], f"out/w/s{k:02d}.txt") for k in range(1, n - 1)}
    return {"s00": ([], "out/s00.txt"), **wide, **last}


def make_project(root: Path, shape: str, n: int, *, fresh: bool = False) -> list[str]:
    """A git + DVC repository of the ``shape`` dvc.yaml, up to date (outs, DVC's cache, dvc.lock) unless ``fresh``."""
    from conveyor.plan.fingerprint import Hasher
    stages, hasher, lock = stages_of(shape, n), Hasher(), dict[str, object]()
    cmd = {s: f"mkdir -p {Path(out).parent} && echo {s} > {out}" for s, (_, out) in stages.items()}
    make_repo(root, {"dvc.yaml": yaml.safe_dump({"stages": {s: {"cmd": cmd[s], **({"deps": deps} if deps else {}),
                     "outs": [out]} for s, (deps, out) in stages.items()}}, sort_keys=False), ".gitignore": "/out\n"},
              dvc=True)
    if fresh:
        return list(stages)

    def entries(paths: list[str]) -> list[dict[str, object]]:
        found = {p: hasher.entry(root, p) for p in paths}
        check(None not in found.values(), f"missing among {paths}")
        return [{"path": p, "hash": "md5", "md5": e.md5, "size": e.size,
                 **({"nfiles": e.nfiles} if e.nfiles is not None else {})} for p, e in found.items() if e]
    for s, (deps, out) in stages.items():  # in order: a stage's deps are written before it
        (root / out).parent.mkdir(parents=True, exist_ok=True)
        (root / out).write_text(f"{s}\n")
        outs = entries([out])
        cached = root / ".dvc/cache/files/md5" / str(outs[0]["md5"])[:2] / str(outs[0]["md5"])[2:]
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / out, cached)
        lock[s] = {"cmd": cmd[s], **({"deps": entries(deps)} if deps else {}), "outs": outs}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock}, sort_keys=False))
    return list(stages)


def decide(folder: Path, shape: str, n: int, repeats: int, log: Callable[[str], None]) -> list[Metric]:
    root, env = folder / f"{shape}-{n}", no_server_env(folder / "prefect-home")
    stages = make_project(root, shape, n)

    def conveyor(what: str) -> float:
        extra = {"CONVEYOR_SNAPSHOT": "0"} if what == COLD else {}  # the first command after a change
        seconds = timed_cli(["conveyor", *COMMANDS[what]], root, {**env, **extra}).seconds
        if what == "no-op run":
            check_record(run_record(root), stages, "skipped", f"{root.name}: the no-op run")
        return seconds
    dvc_status(root, env, "before the repetitions")
    conveyor("no-op run")  # a warm-up, not counted
    base, cand = interleaved(repeats, lambda _i: dvc_status(root, env, "between repetitions", timed=True),
                             lambda _i: {k: conveyor(k) for k in COMMANDS}, log)
    return [Metric(f"{shape} {n}: `conveyor {k}` vs `dvc status` (s)", base, [c[k] for c in cand]) for k in COMMANDS]


def recording(scratch: Path, n: int, server: PrefectServer, log: Callable[[str], None]) -> tuple[float, float]:
    """Seconds per stage of the first and the last hundred stages of a forced run of an n-stage chain."""
    root = scratch / f"record-{n}"
    stages = make_project(root, "chain", n, fresh=True)
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
    with scratch(NAME) as folder:
        (folder / "prefect-home").mkdir()
        metrics = [m for shape in ("chain", "wide") for n in sizes for m in decide(folder, shape, n, repeats, log)]
        check(not leftovers(folder / "prefect-home"), "conveyor's commands left processes")  # ends what they kept
        with PrefectServer() as server:
            first, last = recording(folder, record_n, server, log)
    big, medians = max(sizes), {m.label: (median(m.baseline), median(m.candidate)) for m in metrics}
    worst = max(c for label, (_, c) in medians.items() if label.startswith((f"chain {big}:", f"wide {big}:"))
                and COLD not in label)
    dvc_s, status_s = medians["chain 1000: `conveyor status` vs `dvc status` (s)"]  # the goal's size
    metrics.append(Metric(f"forced {record_n}-stage chain: s per stage, first 100 (baseline) vs last 100",
                          [first], [last], digits=3))
    if not config.quick:
        plot(medians, PLOT)
    return Result(NAME, DESCRIPTION, "`dvc status` in the same up-to-date project (recording: the first hundred)",
                  "the conveyor command of the row, no PREFECT_API_URL (recording: the last hundred)", repeats, metrics,
                  notes=[f"slowest conveyor command at {big} stages: median {worst:.2f} s (goal <= {GOAL_S:g} s at "
                         f"5,000: {met(worst <= GOAL_S)})", f"`conveyor status` / `dvc status` at 1,000 stages (chain):"
                         f" {status_s / dvc_s:.2f}x (goal <= {GOAL_VS_DVC:g}x: {met(status_s / dvc_s <= GOAL_VS_DVC)})",
                         f"recording: {first:.3f} s per stage over the first hundred, {last:.3f} s over the last "
                         f"hundred of {record_n}: {last / first:.2f}x (goal <= {RECORD_GOAL:g}x: "
                         f"{met(last / first <= RECORD_GOAL)})"])


def plot(medians: dict[str, tuple[float, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, shape in zip(axes, ("chain", "wide"), strict=True):
        lines: dict[str, dict[int, float]] = {"dvc status": {}}
        for label, (base, cand) in medians.items():
            if (m := ROW.match(label)) and m[1] == shape:
                lines["dvc status"][int(m[2])], lines.setdefault(f"conveyor {m[3]}", {})[int(m[2])] = base, cand
        for name, points in lines.items():
            ax.plot(sorted(points), [points[x] for x in sorted(points)], marker="o", label=name,
                    **({"linestyle": "--", "color": "black"} if name == "dvc status" else {}))
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
