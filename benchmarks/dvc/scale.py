"""scale: what deciding and recording cost as a pipeline grows from 10 to 5,000 stages.

Two shapes of hand-written dvc.yaml, each stage a trivial ``cmd`` (an ``echo``)::

    chain:  s00 ──► s01 ──► ... ──► s<n-1>        s<k> reads out/s<k-1>.txt, writes out/s<k>.txt
    wide:   s00 ──► s01 ... s<n-2> ──► s<n-1>     s00 writes out/s00.txt; s01..s<n-2> read it and
                 (each)                           write out/w/s<k>.txt; s<n-1> reads the folder out/w

Decide time: each project is made up to date without running 5,000 commands: the outs are
written as the commands would write them and dvc.lock is generated from their hashes (DVC's
format, conveyor's hasher, which gives DVC's hashes); `dvc status` saying the pipeline is up to
date is the check that the generated record is right. Then, interleaved, `dvc status`
(baseline) against `conveyor status`, and a no-op `conveyor run` (PREFECT_API_URL unset: a
no-op starts no server), `conveyor validate`, `dag`, `runs` and `compare` (of the no-op runs'
records: up to 11 records of n stages each), each checked to exit 0 (and
the no-op run's record to say every stage skipped), and `conveyor status` with nothing kept
from the commands before (``CONVEYOR_SNAPSHOT=0``: what the first command after a change
costs; reported, not held to the goals). Goals (issue 34): every read-only command
and the no-op run <= 2 s at 5,000 stages, and <= 0.5x `dvc status` at 1,000.

Recording: a forced `conveyor run` of an n-stage chain (against a `prefect server start`
started here, so no server start is in it), the moment each stage finished read from the run
record: the per-stage cost of the first hundred and of the last hundred stages (goal: the last
within 1.5x the first).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import yaml

from benchmarks.harness import REPO, Config, Metric, Result, check, interleaved, median, met
from benchmarks.prefect_server import PrefectServer
from benchmarks.projects import (
    cli,
    make_repo,
    no_server_env,
    run_record,
    server_env,
    timed_cli,
)

NAME = "scale"
DESCRIPTION = ("decide time (status, no-op run, validate, dag, runs, compare) of 10 to 5,000-stage dvc.yaml chains "
               "and wide DAGs beside dvc status; per-stage recording cost of a forced run of 2,000 stages")
UP_TO_DATE = "Data and pipelines are up to date."
COLD = "status, nothing kept"  # reported beside the goals, not held to them
GOAL_S = 2.0  # every read-only command and a no-op run at 5,000 stages
GOAL_VS_DVC = 0.5  # at 1,000 stages, conveyor status within this many times dvc status
RECORD_GOAL = 1.5  # the last hundred stages' per-stage cost within this many times the first hundred's
PLOT = REPO / "docs" / "img" / "scale.png"  # the curve the README and the docs show, drawn by each full run


def name(k: int) -> str:
    return f"s{k:02d}"


def stages_of(shape: str, n: int) -> dict[str, dict[str, list[str]]]:
    """The deps and outs of each stage of a ``chain`` or a ``wide`` DAG of ``n`` stages."""
    if shape == "chain":
        return {name(k): {"deps": [f"out/{name(k - 1)}.txt"] if k else [], "outs": [f"out/{name(k)}.txt"]}
                for k in range(n)}
    stages = {name(0): {"deps": [], "outs": [f"out/{name(0)}.txt"]}}
    stages.update({name(k): {"deps": [f"out/{name(0)}.txt"], "outs": [f"out/w/{name(k)}.txt"]}
                   for k in range(1, n - 1)})
    if n > 1:
        stages[name(n - 1)] = {"deps": ["out/w"] if n > 2 else [f"out/{name(0)}.txt"],
                               "outs": [f"out/{name(n - 1)}.txt"]}
    return stages


def command(stage: str, body: dict[str, list[str]]) -> str:
    out = body["outs"][0]
    return f"mkdir -p {Path(out).parent} && echo {stage} > {out}"


def dvc_yaml(stages: dict[str, dict[str, list[str]]]) -> str:
    data = {"stages": {s: {"cmd": command(s, b), **({"deps": b["deps"]} if b["deps"] else {}), "outs": b["outs"]}
                       for s, b in stages.items()}}
    return yaml.safe_dump(data, sort_keys=False)


def up_to_date(root: Path, stages: dict[str, dict[str, list[str]]]) -> None:
    """The outs as each command writes them, and dvc.lock recording them (what `dvc repro` would leave)."""
    from conveyor.plan.fingerprint import Hasher

    for stage, body in stages.items():
        path = root / body["outs"][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{stage}\n")
    hasher = Hasher()

    def entries(paths: list[str]) -> list[dict[str, object]]:
        found = []
        for p in paths:
            e = hasher.entry(root, p)
            check(e is not None, f"{p} is missing")
            assert e is not None
            item: dict[str, object] = {"path": p, "hash": "md5", "md5": e.md5, "size": e.size}
            if e.nfiles is not None:
                item["nfiles"] = e.nfiles
            found.append(item)
        return found

    for body in stages.values():  # and in DVC's cache, as `dvc commit` leaves them (else "not in cache")
        e = hasher.entry(root, body["outs"][0])
        assert e is not None
        cached = root / ".dvc/cache/files/md5" / e.md5[:2] / e.md5[2:]
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / body["outs"][0], cached)
    lock = {"schema": "2.0", "stages": {
        s: {"cmd": command(s, b), **({"deps": entries(b["deps"])} if b["deps"] else {}), "outs": entries(b["outs"])}
        for s, b in stages.items()}}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


def make_project(root: Path, shape: str, n: int, *, fresh: bool = False) -> list[str]:
    """A git + DVC repository with the ``shape`` dvc.yaml of ``n`` stages, up to date unless ``fresh``."""
    stages = stages_of(shape, n)
    make_repo(root, {"dvc.yaml": dvc_yaml(stages), ".gitignore": "/out\n"}, dvc=True)
    if not fresh:
        up_to_date(root, stages)
    return list(stages)


# --- decide time ----------------------------------------------------------------------------


def _conveyor(root: Path, env: dict[str, str], *args: str) -> float:
    return timed_cli(["conveyor", *args], root, env).seconds


def _noop_run(root: Path, env: dict[str, str], stages: list[str]) -> float:
    seconds = timed_cli(["conveyor", "run"], root, env).seconds
    record = run_record(root)
    got = {s.get("status") for s in record.get("stages", {}).values()}
    check(record.get("status") == "succeeded" and len(record.get("stages", {})) == len(stages)
          and got == {"skipped"}, f"{root.name}: the no-op run did not skip every stage: {record.get('status')}, {got}")
    return seconds


def _dvc_status(root: Path, env: dict[str, str]) -> float:
    done = timed_cli(["dvc", "status"], root, env)
    check(UP_TO_DATE in done.stdout, f"{root.name}: `dvc status` is not clean:\n{done.stdout[-2000:]}")
    return done.seconds


def decide(scratch: Path, shape: str, n: int, repeats: int, log: Callable[[str], None]) -> list[Metric]:
    root = scratch / f"{shape}-{n}"
    env = no_server_env(scratch / "prefect-home")
    stages = make_project(root, shape, n)
    log(f"{NAME}: {shape} of {n}: made up to date; warm-up (not counted)")
    _dvc_status(root, env)
    _noop_run(root, env, stages)
    commands: dict[str, Callable[[], float]] = {
        "status": lambda: _conveyor(root, env, "status"),
        "no-op run": lambda: _noop_run(root, env, stages),
        "validate": lambda: _conveyor(root, env, "validate"),
        "dag": lambda: _conveyor(root, env, "dag"),
        "runs": lambda: _conveyor(root, env, "runs"),  # the warm-up's record and those of the no-op runs
        "compare": lambda: _conveyor(root, env, "compare"),
        # the first command after a change: nothing kept from the last one (conveyor.spec.snapshot)
        COLD: lambda: _conveyor(root, {**env, "CONVEYOR_SNAPSHOT": "0"}, "status"),
    }
    base, cand = interleaved(repeats, lambda _i: _dvc_status(root, env),
                             lambda _i: {k: fn() for k, fn in commands.items()}, log)
    return [Metric(f"{shape} {n}: `conveyor {k}` vs `dvc status` (s)", list(base), [c[k] for c in cand])
            for k in commands]


# --- recording ------------------------------------------------------------------------------


def recording(scratch: Path, n: int, server: PrefectServer, log: Callable[[str], None]) -> tuple[float, float]:
    """Seconds per stage of the first and the last hundred stages of a forced run of an n-stage chain."""
    root = scratch / f"record-{n}"
    make_project(root, "chain", n, fresh=True)
    log(f"{NAME}: forced run of a {n}-stage chain (dvc.lock the record)")
    cli(["conveyor", "run", "--force"], root, server_env(server), timeout=7200)
    record = run_record(root)
    finished = sorted(datetime.fromisoformat(s["finished"]).timestamp() for s in record["stages"].values())
    check(len(finished) == n and all(s["status"] == "succeeded" for s in record["stages"].values()),
          f"{root.name}: not every stage succeeded")
    status = cli(["dvc", "status"], root, no_server_env(scratch / "prefect-home"))
    check(UP_TO_DATE in status.stdout, f"{root.name}: `dvc status` after the forced run is not clean")
    k = min(100, n // 2)
    first = (finished[k] - finished[0]) / k
    last = (finished[-1] - finished[-1 - k]) / k
    return first, last


# --- the benchmark --------------------------------------------------------------------------


def run(config: Config, log: Callable[[str], None]) -> Result:
    sizes = [10, 100, 1000] if config.quick else [10, 100, 1000, 5000]
    record_n = 200 if config.quick else 2000
    repeats = config.reps(full=5, quick=2)
    scratch = Path(tempfile.mkdtemp(prefix="conveyor-bench-scale-"))
    (scratch / "prefect-home").mkdir()
    metrics: list[Metric] = []
    notes: list[str] = []
    try:
        for shape in ("chain", "wide"):
            for n in sizes:
                metrics += decide(scratch, shape, n, repeats, log)
        big = max(sizes)
        worst = max(median(m.candidate) for m in metrics
                    if m.label.split(":")[0].endswith(f" {big}") and COLD not in m.label)
        notes.append(f"slowest conveyor command at {big} stages: median {worst:.2f} s (goal <= {GOAL_S:g} s at 5,000: "
                     f"{met(worst <= GOAL_S)})")
        at_1000 = [m for m in metrics if m.label.startswith("chain 1000: `conveyor status`")]
        if at_1000:
            share = median(at_1000[0].candidate) / median(at_1000[0].baseline)
            notes.append(f"`conveyor status` / `dvc status` at 1,000 stages (chain): {share:.2f}x "
                         f"(goal <= {GOAL_VS_DVC:g}x: {met(share <= GOAL_VS_DVC)})")
        with PrefectServer() as server:
            first, last = recording(scratch, record_n, server, log)
        metrics.append(Metric(f"forced {record_n}-stage chain: s per stage, first 100 (baseline) vs last 100",
                              [first], [last], digits=3))
        notes.append(f"recording: {first:.3f} s per stage over the first hundred, {last:.3f} s over the last "
                     f"hundred of {record_n}: {last / first:.2f}x (goal <= {RECORD_GOAL:g}x: "
                     f"{met(last / first <= RECORD_GOAL)})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
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
        checks=[f"`dvc status` printed {UP_TO_DATE!r} before and between the repetitions",
                "every conveyor command exited 0; every no-op run's record says every stage skipped",
                "after the forced run every stage succeeded and `dvc status` is clean"],
        notes=notes,
    )


# --- the plot -------------------------------------------------------------------------------

ROW = re.compile(r"^(chain|wide) (\d+): `conveyor ([^`]+)` vs `dvc status` \(s\)$")


def plot(medians: dict[str, tuple[float, float]], path: Path) -> None:
    """Decide time against stages, one panel per shape: `dvc status` and each conveyor command
    (medians, log-log), the 2 s goal drawn across. ``medians``: metric label -> (baseline, candidate)."""
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
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name,
                    linestyle="--" if name == "dvc status" else "-", color="black" if name == "dvc status" else None)
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


def medians_of(result_file: Path) -> dict[str, tuple[float, float]]:
    """The medians of a written result file's "per repetition" values, by metric label."""
    found: dict[str, tuple[float, float]] = {}
    lines = result_file.read_text(encoding="utf-8").splitlines()
    for at, line in enumerate(lines):
        if ROW.match(line.strip().rstrip(":")) and at + 2 < len(lines):
            base, cand = ([float(v) for v in lines[at + k].split("[", 1)[1].rstrip("]").split(",")] for k in (1, 2))
            found[line.strip().rstrip(":")] = (median(base), median(cand))
    return found


if __name__ == "__main__":  # python -m benchmarks.dvc.scale RESULT_FILE: the plot again, from a written result
    plot(medians_of(Path(sys.argv[1])), PLOT)
    print(PLOT)
