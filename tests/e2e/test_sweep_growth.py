"""A sweep grown step by step in a DVC project (issue 33): the stage that ``needs`` the matrix
sees every item's outs, and a value added to the matrix list (in params.yaml, or with ``-S``)
runs the new item and what needs it, with no `conveyor compile` in between; a value removed
runs what needed it again; ``dvc status`` agrees after each run. A ``-S`` the run refuses
leaves params.yaml byte for byte.

    fit@0.1  ┐
    fit@10.0 ├──► pick      (fit: matrix over params.yaml's sweep.alphas; pick needs: [fit])
    fit@...  ┘
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
from projects import Project
from repos import ANALYTICS_OFF, git_dvc_init

TASKS = '''
import json


def fit(ctx):
    alpha = ctx.item["alpha"]
    ctx.out().write_text(json.dumps({"alpha": alpha, "rounds": ctx.params["fit.rounds"]}))
    ctx.metric().write_text(json.dumps({"rmse": abs(alpha - 10.0) + 1}))


def pick(ctx):
    items = ctx.items("fit")
    best = min(items.values(), key=lambda it: it.scores()["rmse"])
    ctx.out().write_text(json.dumps({
        "items": {name: [str(it.out().relative_to(ctx.root)), it.values] for name, it in items.items()},
        "deps": sorted(ctx.deps),
        "best": best.stage,
        "model": json.loads(best.out().read_text()),
    }))
'''

SPEC = """
pipeline: grow
stages:
  fit:
    task: tasks.steps:fit
    matrix:
      alpha: ${sweep.alphas}
    params: [fit.rounds]
    outs:
      - models/m-${key}.json
    metrics:
      - metrics/m-${key}.json
  pick:
    task: tasks.steps:pick
    needs: [fit]
    outs: [models/best.json]
"""

PARAMS = "fit:\n  rounds: 3\nsweep:\n  alphas: [0.1, 10.0]  # the grid\n"


def sweep_project(make_project: Callable[[], Project]) -> Project:
    """A git + DVC repo holding the sweep above, compiled and committed, as `conveyor init` leaves one."""
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("params.yaml", PARAMS)
    project.write("configs/pipeline.yaml", SPEC)
    project.write(".gitignore", "/.conveyor/\n__pycache__/\n")
    git_dvc_init(project.root, ANALYTICS_OFF)
    project.sh("git", "config", "user.email", "test@example.com")
    project.sh("git", "config", "user.name", "conveyor tests")
    assert project.conveyor("compile").returncode == 0
    project.sh("git", "add", "-A")
    project.sh("git", "commit", "-qm", "sweep")
    return project


def ran(project: Project) -> list[str]:
    """The stages the last run ran (not skipped), in its record's order."""
    return [n for n, s in project.record()["stages"].items() if s["status"] == "succeeded"]


def table(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """`conveyor status` (or `run --dry-run`) as {stage: why}; '' for up to date."""
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 3 and cells[0].startswith(("fit", "pick")):
            rows[cells[0]] = cells[2]
    return rows


def dvc_clean(project: Project) -> bool:
    return "Data and pipelines are up to date" in project.sh("dvc", "status").stdout


@pytest.mark.slow
def test_a_sweep_grows_in_params_yaml_and_with_set_param(make_project: Callable[[], Project]) -> None:
    project = sweep_project(make_project)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    assert ran(project) == ["fit@0.1", "fit@10.0", "pick"]
    best = json.loads((project.root / "models/best.json").read_text())
    # the stage that needs the matrix gets every item: its values, its outs, its metrics
    assert best["items"] == {"fit@0.1": ["models/m-0.1.json", {"alpha": 0.1}],
                             "fit@10.0": ["models/m-10.0.json", {"alpha": 10.0}]}
    assert best["deps"] == ["metrics/m-0.1.json", "metrics/m-10.0.json", "models/m-0.1.json", "models/m-10.0.json"]
    assert best["best"] == "fit@10.0" and best["model"] == {"alpha": 10.0, "rounds": 3}
    assert dvc_clean(project)
    dvc_yaml = (project.root / "dvc.yaml").read_text()

    # grown in params.yaml: the questions answer without writing, the run compiles dvc.yaml again
    project.write("params.yaml", PARAMS.replace("10.0]", "10.0, 100.0]"))
    due = {"fit@0.1": "", "fit@10.0": "", "fit@100.0": "never run", "pick": "dep missing: models/m-100.0.json; "
           "dep missing: metrics/m-100.0.json; upstream 'fit@100.0' is stale"}
    assert table(project.conveyor("status")) == due
    assert table(project.conveyor("run", "--dry-run")) == due
    assert (project.root / "dvc.yaml").read_text() == dvc_yaml
    grown = project.conveyor("run")
    assert grown.returncode == 0, grown.stdout + grown.stderr
    assert "dvc.yaml compiled again from configs/pipeline.yaml" in grown.stderr
    assert ran(project) == ["fit@100.0", "pick"]
    assert "models/m-100.0.json" in (project.root / "dvc.yaml").read_text()
    assert list(json.loads((project.root / "models/best.json").read_text())["items"]) == [
        "fit@0.1", "fit@10.0", "fit@100.0"]
    assert dvc_clean(project)

    # --dry-run -S: the plan with the value set, and nothing written
    before = (project.root / "params.yaml").read_bytes()
    dry = project.conveyor("run", "--dry-run", "-S", "fit.rounds=4")
    assert table(dry) == {**dict.fromkeys(["fit@0.1", "fit@10.0", "fit@100.0"], "params changed: fit.rounds 3 → 4"),
                          "pick": "upstream 'fit@0.1', 'fit@10.0', 'fit@100.0' are stale"}
    assert table(project.conveyor("run", "--dry-run", "-S", "sweep.alphas=[0.1, 10.0, 100.0, 1000.0]")) == {
        **due, "fit@100.0": "", "fit@1000.0": "never run", "pick": "dep missing: models/m-1000.0.json; "
        "dep missing: metrics/m-1000.0.json; upstream 'fit@1000.0' is stale"}
    assert (project.root / "params.yaml").read_bytes() == before

    # grown with -S: the file keeps its flow list and its comment; only the new item and pick run
    grown = project.conveyor("run", "-S", "sweep.alphas=[0.1, 10.0, 100.0, 1000.0]")
    assert grown.returncode == 0, grown.stdout + grown.stderr
    assert ran(project) == ["fit@1000.0", "pick"]
    assert (project.root / "params.yaml").read_text() == PARAMS.replace("10.0]  #", "10.0, 100.0, 1000.0] #")
    assert project.record()["overrides"] == {"sweep.alphas": [0.1, 10.0, 100.0, 1000.0]}
    assert dvc_clean(project)

    # shrunk, the best item dropped: no item runs, pick runs again (DVC alone would call it up to date)
    shrunk = project.conveyor("run", "-S", "sweep.alphas=[0.1, 100.0, 1000.0]")
    assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
    assert ran(project) == ["pick"]
    assert sorted(project.record()["stages"]["pick"]["reason"].split("; ")) == [
        "dep removed: metrics/m-10.0.json", "dep removed: models/m-10.0.json"]
    best = json.loads((project.root / "models/best.json").read_text())
    assert list(best["items"]) == ["fit@0.1", "fit@100.0", "fit@1000.0"] and best["best"] == "fit@0.1"
    assert dvc_clean(project)
    assert "Traceback" not in grown.stderr and not project.left_running()


@pytest.mark.slow
def test_a_refused_set_param_writes_nothing(make_project: Callable[[], Project]) -> None:
    project = sweep_project(make_project)
    before = (project.root / "params.yaml").read_bytes()

    empty = project.conveyor("run", "-S", "sweep.alphas=[]")  # a matrix of nothing: the spec refuses it
    assert empty.returncode == 2, empty.stdout + empty.stderr
    assert "'alpha' must list its values" in empty.stderr and "Traceback" not in empty.stderr
    assert (project.root / "params.yaml").read_bytes() == before

    # another run holds the project's run lock (a process of its own, as a teammate's run would)
    (project.root / ".conveyor").mkdir(exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; f = open('.conveyor/run.lock', 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.seek(0); f.truncate(); f.write(str(os.getpid())); f.flush(); print('held', flush=True); sys.stdin.read()")],
        cwd=project.root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        locked = project.conveyor("run", "-S", "sweep.alphas=[0.1, 10.0, 100.0]")
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert locked.returncode == 1, locked.stdout + locked.stderr
    assert f"another conveyor run holds {project.root / '.conveyor/run.lock'} (pid {holder.pid})" in locked.stderr
    assert (project.root / "params.yaml").read_bytes() == before
    assert "Traceback" not in locked.stderr
