"""Helpers for end-to-end tests: projects in tmp_path, `conveyor` as a user runs it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pytest
from repos import ANALYTICS_OFF, dvc, git_dvc_init
from subprocs import FAILED, cmdline, is_warm_runner

REPO = Path(__file__).resolve().parents[1]


def prefect_api(url: str) -> Any:
    """A Prefect client of the API at ``url`` for a test's own questions (``with prefect_api(url) as api``),
    on the TLS context conveyor's runs share (conveyor.prefect.tls): each new client otherwise parses
    the CA file's certificates (16 to 20 ms), and the tests that poll the API made a few hundred."""
    from prefect.client.orchestration import SyncPrefectClient

    from conveyor.prefect.tls import context

    return SyncPrefectClient(url, httpx_settings={"verify": context()})


@dataclass
class Project:
    """A conveyor project in a temporary directory, run through the real console script."""

    root: Path
    env: dict[str, str]
    tag: str

    @classmethod
    def at(cls, root: Path, prefect_server: Mapping[str, str]) -> Project:
        """The project in ``root``, run against ``prefect_server`` under a tag of its own."""
        tag = uuid.uuid4().hex
        return cls(root, {**os.environ, **prefect_server, "CONVEYOR_TEST_TAG": tag, "COLUMNS": "200"}, tag)

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
        return path

    def conveyor(self, *args: str, timeout: float = 600, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``conveyor ARGS`` in the project (or ``cwd``); ``env``: variables over the project's own."""
        return subprocess.run(["conveyor", *args], cwd=cwd or self.root, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def sh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command (git, dvc, ...) in the project with its environment; with ``check``, it must
        succeed. DVC's commands that set a repository up or read it run in this process (:func:`repos.dvc`)."""
        done = dvc(self.root, *args[1:], env=self.env) if args[0] == "dvc" else \
            subprocess.run(args, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=300)
        if check:
            assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def init_dvc(self) -> None:
        """Make the project a git + DVC repository, DVC's analytics off."""
        git_dvc_init(self.root, ANALYTICS_OFF)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        """``conveyor`` as a terminal starts it: SIGINT at its default, even when the tests run
        as a background job of a script (which ignores SIGINT, and its children inherit that)."""
        return subprocess.Popen(["conveyor", *args], cwd=self.root, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_default_sigint)

    def record(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.root / ".conveyor/runs/latest.json").read_text())
        return data

    def left_running(self, grace_s: float = 3.0) -> list[psutil.Process]:
        """Processes of this project's runs still alive ``grace_s`` after the run ended.

        A grace, not zero: Python's multiprocessing resource tracker (started by loky and
        Dask) exits only when the runner's end of its pipe closes, a few milliseconds after it.
        """
        deadline = time.monotonic() + grace_s
        while (left := self.tagged_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def tagged_processes(self) -> list[psutil.Process]:
        """Processes started by this project's runs (they inherit its tag), still alive, and a run a
        warm runner forked in the project (its /proc environ is the runner's, which has no tag)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("CONVEYOR_TEST_TAG") == self.tag or _forked_here(proc, self.root):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def run_pid(self, proc: subprocess.Popen[str]) -> int:
        """The process that runs the pipeline of ``proc`` (a ``conveyor run`` under way): ``proc``
        itself, or the child a warm runner forked for it (``proc`` stays as its stand-in)."""
        for candidate in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if _forked_here(candidate, self.root):
                    return candidate.pid
        return proc.pid


def _forked_here(proc: psutil.Process, root: Path) -> bool:
    """Whether ``proc`` is a run forked by a warm runner (conveyor.cli.warm_runner) in ``root``."""
    parent = proc.parent()
    return parent is not None and is_warm_runner(parent) and Path(proc.cwd()).is_relative_to(root)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def make_project(request: pytest.FixtureRequest, tmp_path: Path,
                 prefect_server: dict[str, str]) -> Iterator[Callable[[], Project]]:
    """A fresh project root that runs against the session's Prefect server. After a test that
    failed, whatever its projects' runs left running is killed: an assertion that fails while a
    run waits (for a file the test would have written) leaves nothing running for the rest of the
    suite and after it."""
    made: list[Project] = []

    def make() -> Project:
        root = tmp_path / f"proj-{uuid.uuid4().hex[:6]}"
        root.mkdir()
        (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
        made.append(Project.at(root, prefect_server))
        return made[-1]

    yield make
    if request.node.stash.get(FAILED, False):
        for project in made:
            for proc in project.tagged_processes():
                with contextlib.suppress(psutil.Error):
                    proc.kill()


@pytest.fixture
def reference_project(make_project: Callable[[], Project]) -> Project:
    """A copy of this repository's reference pipeline (spec, params, tasks) in tmp_path."""
    project = make_project()
    for rel in ("configs", "tasks"):
        shutil.copytree(REPO / rel, project.root / rel, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "params.yaml", project.root / "params.yaml")
    return project


@dataclass(frozen=True)
class FirstRun:
    """A ``git clone`` of this repository after its first ``conveyor run`` (the README's Quick start),
    made once per test run (:func:`first_run`), and what that run printed. Tests run in copies."""

    root: Path
    returncode: int
    stdout: str
    stderr: str
    left_running: list[str]

    def copy(self, to: Path, prefect_server: Mapping[str, str]) -> Project:
        """The clone as that run left it, in ``to`` (a new folder), run against ``prefect_server``."""
        assert self.returncode == 0, f"the first run of a fresh clone failed:\n{self.stderr[-3000:]}"
        shutil.copytree(self.root, to, symlinks=True)
        return Project.at(to, prefect_server)


def once_per_test_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """What ``make(folder)`` returned (a JSON value), ``folder`` being ``name`` in the test run's folder: made
    by the first of the test run's processes to ask, the others wait for it on a lock there and read it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the test run's folder, which holds each test process's own
    result = shared / f"{name}.json"
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the one who makes it is done
        if not result.exists():
            folder = shared / name
            shutil.rmtree(folder, ignore_errors=True)  # what a process interrupted while making it left
            result.write_text(json.dumps(make(folder)))
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def first_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> FirstRun:
    """:class:`FirstRun`, shared by the test run's processes (:func:`once_per_test_run`): a clone of this
    repository and its first run (the reference pipeline, all six stages)."""
    def clone_and_run(root: Path) -> dict[str, Any]:
        subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True, timeout=300)
        project = Project.at(root, prefect_server)
        done = project.conveyor("run")
        left = [" ".join(cmdline(proc)) or str(proc.pid) for proc in project.left_running()]
        return {"root": str(root), "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                "left_running": left}

    data = once_per_test_run(tmp_path_factory, "first-run", clone_and_run)
    return FirstRun(**{**data, "root": Path(data["root"])})


# A project whose model is a linear function (numpy only): fast to score, exact to check.
# A command stage that saves its first half in its checkpoint folder, says so, and fails; run
# again with that save there, it writes both halves: what resuming from a checkpoint does.
HALVES = """
set -e
if [ -e "$CONVEYOR_CHECKPOINT_DIR/first-half" ]; then
  cp "$CONVEYOR_CHECKPOINT_DIR/first-half" out.txt && echo second >> out.txt && exit 0
fi
echo first > "$CONVEYOR_CHECKPOINT_DIR/first-half"
python -c "from conveyor.run.checkpoints import current; current().mark(1, 2, 'half')"
echo stopped half-way >&2
exit 3
"""

LINEAR_FEATURES = [f"x{i}" for i in range(8)]
LINEAR_WEIGHTS = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5, -2.0, 1.0]
LINEAR_SPEC = """\
pipeline: linear
stages:
  fit: {task: tasks.linear:fit, outs: [models/linear.json]}
model:
  files: {weights: models/linear.json}
  features: models/linear.json:features
  load: tasks.linear:load
  predict: tasks.linear:predict
  id: key
"""
LINEAR_TASKS = """\
import json

import numpy as np


def fit(ctx):
    (ctx.root / "models").mkdir(exist_ok=True)
    (ctx.root / "models/linear.json").write_text(json.dumps({"features": [], "weights": []}))


def load(files):
    return json.loads(files["weights"].read_text())


def predict(model, rows):
    return rows.to_numpy() @ np.asarray(model["weights"]) + model["bias"]
"""


def assert_ran_on_remote(project: Project) -> None:
    """The reference pipeline ran with its cpu and gpu profiles swapped for ``remote`` (a cluster of
    2 workers), and ends with the very metrics of the local run this repository commits."""
    stages = project.record()["stages"]
    assert {n: s["profile"] for n, s in stages.items()} == {
        "ingest": "io", "preprocess": "remote", "train_xgb": "remote", "train_mlp": "local",
        "stack": "local", "evaluate": "local"}
    metrics = json.loads((project.root / "metrics/test.json").read_text())
    assert metrics["stack"]["auc"] >= 0.97
    assert metrics == json.loads((REPO / "metrics/test.json").read_text())  # its cpu profile: 2 workers, 1 thread
    assert json.loads((project.root / "metrics/train_xgb.json").read_text())["n_workers"] == 2


def linear_model(bias: float = 0.5) -> str:
    """The content of models/linear.json: the features, the weights and ``bias``."""
    return json.dumps({"features": LINEAR_FEATURES, "weights": LINEAR_WEIGHTS, "bias": bias})


def linear_scores(frame: pd.DataFrame, bias: float = 0.5) -> np.ndarray:
    """What the linear model scores ``frame``'s rows."""
    return np.asarray(frame[LINEAR_FEATURES].to_numpy() @ np.asarray(LINEAR_WEIGHTS) + bias)


@pytest.fixture
def linear_project(make_project: Callable[[], Project]) -> Project:
    """A project with the linear model's files in place (as if ``fit`` had run), no champion yet."""
    project = make_project()
    project.write("configs/pipeline.yaml", LINEAR_SPEC)
    project.write("tasks/__init__.py", "")
    project.write("tasks/linear.py", LINEAR_TASKS)
    project.write("models/linear.json", linear_model())
    return project


def evaluated_test_rows(root: Path, raw: pd.DataFrame) -> tuple[list[int], list[float]]:
    """For a trained reference project: the index in ``raw`` of each row of the test split, and
    the stacked model's score of that row as the evaluate stage computes it."""
    from tasks.evaluate import model_probabilities
    from tasks.models import read_split
    from tasks.preprocess import load_stats, standardise_rows

    processed = root / "data/processed"
    stats = load_stats(processed)
    test = read_split(processed, "test")
    standardised = standardise_rows(raw, stats["features"], pd.Series(stats["mean"]), pd.Series(stats["std"]))
    where = {tuple(row): i for i, row in enumerate(standardised.to_numpy())}
    ids = [where[tuple(row)] for row in test.features.to_numpy()]  # the raw row of each test row
    evaluated = model_probabilities(test.features, *(root / p for p in (
        "models/xgb.json", "models/mlp.pt", "models/stack.json")))["stack"]
    return ids, evaluated.tolist()


# `conveyor run` whose dvc.lock writes never come (each entry stays in its pending log), killed
# once both stages have succeeded: the worst moment for entries written in batches.
RUN_PENDING_AND_DIE = """
import os, signal, sys
from conveyor.dvc.lockfile import LockWriter
from conveyor.run.record import RunEvents

LockWriter.flush = lambda self: None
stage_event = RunEvents.stage

def dying(self, stage, record):
    stage_event(self, stage, record)
    if stage == "two" and record.status == "succeeded":
        os.kill(os.getpid(), signal.SIGKILL)

RunEvents.stage = dying
from conveyor.cli.app import main

sys.argv = ["conveyor", "run"]
main()
"""


def age(root: Path, seconds: float = 60.0, *, folders: bool = True) -> None:
    """Every file (and folder) of the project as if last written ``seconds`` ago (a load right after
    a folder changed keeps no snapshot: it cannot tell what came after)."""
    then = time.time() - seconds
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            os.utime(os.path.join(folder, name), (then, then))
        if folders:
            os.utime(folder, (then, then))
