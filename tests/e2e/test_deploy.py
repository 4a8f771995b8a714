"""Deployments and scheduled retraining against the session's real Prefect server.

Everything runs as a user runs it: `conveyor deploy`, `prefect worker start`, `conveyor
serve` and `prefect deployment run` as subprocesses (most runs are created by the API call
that command makes, from the test's process), with this repository's prefect.yaml and flows/
copied into a small project whose metric the test controls from params.yaml::

    ingest (io) ──► train ──► evaluate
    data/raw        models/stack.json   metrics/test.json {"stack": {"auc": <evaluate.auc>}}

``ingest`` reads ``source.txt``, named in params like a URL and not a dep: only a forced
ingest (what retraining does) sees new data there.

The deployment-level tests share one `conveyor serve` process (module scope). The test
that registers on the work pool runs first: registering again from another directory
would point the deployments' working directory elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pandas as pd
import psutil
import pytest
import yaml
from projects import prefect_api
from repos import git_dvc_init
from subprocs import stop_group

from conveyor.predict.model import version_of

REPO = Path(__file__).resolve().parents[2]

TASKS = '''
import contextlib
import json


def ingest(ctx):
    source = ctx.root / ctx.params["ingest"]["source"]
    out = ctx.outs["data/raw"]
    out.mkdir(parents=True)
    (out / "rows.csv").write_text(source.read_text())


def train(ctx):
    if ctx.params["train"].get("fail"):
        raise RuntimeError("training broke on purpose")
    rows = (ctx.deps["data/raw"] / "rows.csv").read_text().split()
    ctx.outs["models/stack.json"].write_text(json.dumps({"rows": len(rows), "depth": ctx.params["train"]["depth"]}))


def score(model, rows):  # the model section's predict: the row count the model was trained on
    return rows["x"] * 0 + json.loads(model["stack"].read_text())["rows"]


def evaluate(ctx):
    auc = ctx.params["evaluate"]["auc"]
    ctx.metrics["metrics/test.json"].write_text(json.dumps({"stack": {"auc": auc, "loss": round(1 - auc, 6)}}))
'''

SPEC = """
pipeline: toy
profiles:
  io: {kind: threads, max_workers: 2}
stages:
  ingest: {task: tasks.steps:ingest, on: io, params: [ingest], outs: [data/raw]}
  train: {task: tasks.steps:train, deps: [data/raw], params: [train], outs: [models/stack.json]}
  evaluate:
    task: tasks.steps:evaluate
    deps: [data/raw, models/stack.json]
    params: [evaluate]
    metrics: [metrics/test.json]
model: {files: {stack: models/stack.json}, features: [x], predict: "tasks.steps:score"}
"""

RUN_DEADLINE_S = 150
PIPELINE, RETRAIN = "breast-cancer/pipeline", "breast-cancer-retrain/retrain"  # the reference project's flows


@dataclass
class Project:
    """A project directory and the environment its commands run in (as conftest's ``Project``;
    defined here too because ``from conftest import`` depends on which conftest pytest loaded last)."""

    root: Path
    env: dict[str, str]

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    def conveyor(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["conveyor", *args], cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def record(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.root / ".conveyor/runs/latest.json").read_text())
        return data


@pytest.fixture
def project(make_project: Callable[[], Any]) -> Project:
    """A fresh project root that runs against the session's Prefect server."""
    made = make_project()
    return Project(made.root, made.env)


def toy(project: Project, *, auc: float = 0.80, dvc: bool = False) -> None:
    """The toy pipeline with this repository's prefect.yaml and flows/; with ``dvc``, a git + DVC repo."""
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("configs/pipeline.yaml", SPEC)
    project.write("source.txt", "1 2 3\n")
    set_params(project, auc=auc)
    shutil.copy(REPO / "prefect.yaml", project.root / "prefect.yaml")
    shutil.copytree(REPO / "flows", project.root / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    if dvc:
        git = ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci"]
        git_dvc_init(project.root)
        for cmd in (["conveyor", "compile"], ["git", "add", "-A"], [*git, "commit", "-qm", "toy"]):
            subprocess.run(cmd, cwd=project.root, env=project.env, check=True, capture_output=True)


def set_params(project: Project, *, auc: float, train_fails: bool = False) -> None:
    project.write("params.yaml", yaml.safe_dump({
        "ingest": {"source": "source.txt"}, "train": {"depth": 3, "fail": train_fails}, "evaluate": {"auc": auc}}))


def prefect(project: Project, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["prefect", *args], cwd=project.root, env=project.env, capture_output=True, text=True,
                          timeout=timeout)


def deployment_run(project: Project, name: str, *params: str, cli: bool = False) -> str:
    """`prefect deployment run NAME --param k=v ...`; returns the flow run id. Without ``cli``, the
    call the command makes (a flow run created from the deployment, each value read as JSON or else
    as a string, as ``--param`` reads it) from this process: the command itself costs 1.6 CPU-s to
    import Prefect's CLI, and `conveyor serve` runs either alike."""
    if cli:
        done = prefect(project, "deployment", "run", name, *[a for p in params for a in ("--param", p)])
        assert done.returncode == 0, done.stdout + done.stderr
        found = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
        assert found, done.stdout
        return found.group(1)
    parameters: dict[str, Any] = {}
    for param in params:
        key, _, value = param.partition("=")
        try:
            parameters[key] = json.loads(value)
        except ValueError:
            parameters[key] = value
    with client(project) as api:
        return str(api.create_flow_run_from_deployment(api.read_deployment_by_name(name).id,
                                                       parameters=parameters).id)


def client(project: Project) -> Any:
    return prefect_api(project.env["PREFECT_API_URL"])


def wait_final(project: Project, flow_run_id: str, deadline_s: float = RUN_DEADLINE_S) -> Any:
    """Poll the API until the flow run reaches a final state; fails past the deadline."""
    deadline = time.monotonic() + deadline_s
    with client(project) as api:
        while time.monotonic() < deadline:
            run = api.read_flow_run(uuid.UUID(flow_run_id))
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id} not finished after {deadline_s}s (state {run.state})")


def artifacts(project: Project, flow_run_id: str) -> dict[str, str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(project) as api:
        found = api.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {a.key: str(a.data) for a in found if a.key}


def task_runs(project: Project, flow_run_id: str) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(project) as api:
        ids = FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])
        return list(api.read_task_runs(flow_run_filter=FlowRunFilter(id=ids)))


def flow_run_logs(project: Project, flow_run_id: str) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with client(project) as api:
        found = api.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])))
    return [log.message for log in found]


def deployment_runs(project: Project, name: str, *, scheduled_only: bool = False) -> list[Any]:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with client(project) as api:
        deployment = api.read_deployment_by_name(name)
        state = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])))
        return list(api.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                                       flow_run_filter=state if scheduled_only else None))


def registry(project: Project) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((project.root / "models/registry.json").read_text())
    return data


def lock_md5(project: Project, stage: str) -> str:
    lock = yaml.safe_load((project.root / "dvc.lock").read_text())
    md5: str = lock["stages"][stage]["outs"][0]["md5"]
    return md5


# ---------------------------------------------------------------- conveyor deploy, a process worker


@pytest.mark.slow
def test_deploy_creates_the_pool_registers_both_deployments_and_a_worker_runs_them(project: Project) -> None:
    from cronsim import CronSim
    from prefect.exceptions import ObjectNotFound

    toy(project)
    with client(project) as api, contextlib.suppress(ObjectNotFound):
        api.delete_work_pool("conveyor")  # so that `conveyor deploy` has to create it
    since = datetime.now(UTC)
    done = project.conveyor("deploy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "created process work pool 'conveyor'" in done.stdout
    declared = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    with client(project) as api:
        assert api.read_work_pool("conveyor").type == "process"
        pipeline = api.read_deployment_by_name(PIPELINE)
        retrain = api.read_deployment_by_name(RETRAIN)
    for deployment, name in ((pipeline, "pipeline"), (retrain, "retrain")):
        assert deployment.work_pool_name == "conveyor"
        assert deployment.parameters == declared[name]["parameters"]
        assert deployment.enforce_parameter_schema
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                          {"directory": str(project.root.resolve())}}]
    assert (pipeline.entrypoint, retrain.entrypoint) == ("flows/pipeline.py:pipeline", "flows/retrain.py:retrain")
    assert pipeline.schedules == []

    # The retrain schedule: the server's next runs are the cron's next times, in its timezone.
    cron = declared["retrain"]["schedules"][0]
    [schedule] = retrain.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == (cron["cron"], cron["timezone"])
    assert schedule.active
    deadline = time.monotonic() + 60
    while len(scheduled := deployment_runs(project, RETRAIN, scheduled_only=True)) < 3:
        assert time.monotonic() < deadline, (
            "the server scheduled no retrain runs within 60s; Prefect 3.8's scheduler fails on SQLAlchemy 2.1 "
            "('Can't evaluate bulk DML statement' in the server log): install sqlalchemy<2.1")
        time.sleep(1)
    starts = sorted(r.expected_start_time for r in scheduled)[:3]
    expected = CronSim(cron["cron"], since.astimezone(ZoneInfo(cron["timezone"])))
    assert starts == [next(expected) for _ in starts]

    # `prefect worker start --pool conveyor` runs a deployment run in the project directory.
    flow_run_id = deployment_run(project, PIPELINE, cli=True)
    worker = subprocess.run(["prefect", "worker", "start", "--pool", "conveyor", "--run-once"], cwd="/",
                            env=project.env, capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    run = wait_final(project, flow_run_id, deadline_s=30)
    assert run.state.is_completed(), worker.stdout + worker.stderr
    assert run.name.startswith("toy-")
    assert project.record()["flow_run_id"] == flow_run_id
    assert "conveyor-run-summary" in artifacts(project, flow_run_id)


@pytest.mark.slow
def test_deploy_refuses_bad_parameters_before_registering_anything(project: Project) -> None:
    toy(project)
    text = (project.root / "prefect.yaml").read_text()
    (project.root / "prefect.yaml").write_text(text.replace("stages: []", "stages: [trian]"))
    done = project.conveyor("deploy")
    assert done.returncode == 1
    assert "prefect.yaml deployment 'pipeline': unknown stage(s): trian (did you mean 'train'?)" in done.stderr
    assert "Deploying" not in done.stdout
    (project.root / "prefect.yaml").write_text(text.replace("direction: max", "direction: up"))
    done = project.conveyor("deploy")
    assert done.returncode == 1
    assert "prefect.yaml deployment 'retrain'" in done.stderr and "Input should be 'max' or 'min'" in done.stderr


@pytest.mark.slow
def test_deploy_and_serve_need_a_prefect_server_and_a_prefect_yaml(tmp_path: Path, project: Project) -> None:
    done = project.conveyor("serve")
    assert done.returncode == 1
    assert f"no prefect.yaml in {project.root}" in done.stderr
    env = {k: v for k, v in project.env.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "home")  # a profile that names no server
    project = Project(project.root, env)
    done = project.conveyor("deploy")
    assert done.returncode == 1
    assert "no Prefect API: start a server (`prefect server start`)" in done.stderr
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # nothing listens on the discard port
    done = project.conveyor("serve")
    assert done.returncode == 1
    assert "the Prefect API at http://127.0.0.1:9/api does not answer" in done.stderr


# ---------------------------------------------------------------- conveyor serve


@dataclass
class Served:
    project: Project
    log: Path
    proc: subprocess.Popen[bytes]  # `conveyor serve`: it starts a process per flow run


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> Iterator[Served]:
    """A git + DVC toy project served by `conveyor serve` (both deployments) for this module."""
    root = tmp_path_factory.mktemp("served")
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    project = Project(root, {**os.environ, **prefect_server, "COLUMNS": "200"})
    toy(project, dvc=True)
    log = root.parent / f"{root.name}-serve.log"
    since = datetime.now(UTC)
    with log.open("wb") as out:
        proc = subprocess.Popen(["conveyor", "serve"], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                env={**project.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}, start_new_session=True)
    try:
        _wait_polled(project, proc, log, since)
        yield Served(project, log, proc)
    finally:
        stop_group(proc, timeout=30)


def _wait_polled(project: Project, proc: subprocess.Popen[bytes], log: Path, since: datetime) -> None:
    """Until the serve process registered both deployments and polls them for runs."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"conveyor serve exited {proc.returncode}:\n{log.read_text()}"
        with client(project) as api:
            try:
                polled = [api.read_deployment_by_name(n) for n in (PIPELINE,
                                                                    RETRAIN)]
            except Exception:  # not registered yet
                polled = []
        if polled and all(d.last_polled and d.last_polled > since and not d.pull_steps for d in polled):
            return
        time.sleep(0.5)
    raise AssertionError(f"conveyor serve did not start serving in 90s:\n{log.read_text()}")


@pytest.mark.slow
def test_a_served_pipeline_deployment_run_completes_with_its_summary(served: Served) -> None:
    project = served.project
    # set_params: what `conveyor run -S` does, from a deployment run's parameters
    flow_run_id = deployment_run(project, PIPELINE, 'set_params=["train.depth=4"]')
    run = wait_final(project, flow_run_id)
    assert run.state.is_completed(), f"{run.state.message}\n{served.log.read_text()[-3000:]}"
    assert run.name.startswith("toy-")
    record = project.record()
    assert (record["status"], record["flow_run_id"]) == ("succeeded", flow_run_id)
    assert record["overrides"] == {"train.depth": 4}
    assert yaml.safe_load((project.root / "params.yaml").read_text())["train"]["depth"] == 4
    found = artifacts(project, flow_run_id)
    summary = found["conveyor-run-summary"]
    assert summary.startswith("# toy: succeeded") and "| ingest |" in summary
    # the rows of `conveyor compare RUN`: params as they ran (* set for this run), then metrics
    assert json.loads(found["conveyor-run-params-metrics"]) == [{
        "run": record["run_id"], "item": "-", "evaluate.auc": "0.8", "ingest.source": "source.txt",
        "train.depth": "4*", "train.fail": "false", "evaluate:stack.auc": "0.8", "evaluate:stack.loss": "0.2"}]


@pytest.mark.slow
def test_retraining_promotes_only_a_better_challenger_and_a_failure_keeps_the_champion(served: Served) -> None:
    project = served.project
    assert not (project.root / "models/registry.json").exists()

    def retrain(*params: str, completed: bool = True) -> tuple[str, dict[str, Any]]:
        flow_run_id = deployment_run(project, RETRAIN, *params)
        run = wait_final(project, flow_run_id)
        assert run.state.is_completed() is completed, f"{run.state.message}\n{served.log.read_text()[-3000:]}"
        assert run.name.startswith("toy-retrain-")
        assert set(artifacts(project, flow_run_id)) == {"conveyor-run-summary", "conveyor-run-params-metrics",
                                                        "conveyor-promotion"}
        return flow_run_id, registry(project)

    # The first challenger becomes champion; the model is copied aside, versions recorded.
    set_params(project, auc=0.80)
    first_id, book = retrain()
    first = book["champion"]
    assert (first["status"], first["value"], first["flow_run_id"]) == ("promoted", 0.80, first_id)
    assert first["data_version"] == {"data/raw": lock_md5(project, "ingest")}
    assert first["model_md5"] == lock_md5(project, "train")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project.root, capture_output=True, text=True).stdout
    assert first["git_commit"] == head.strip()
    assert project.record()["stages"]["ingest"]["reason"] == "forced"

    # New data at the source and a better metric: promoted. Only the forced ingest saw the new data.
    (project.root / "source.txt").write_text("1 2 3 4 5\n")
    set_params(project, auc=0.90)
    better_id, book = retrain()
    better = book["champion"]
    assert (better["status"], better["value"], better["flow_run_id"]) == ("promoted", 0.90, better_id)
    assert better["data_version"] != first["data_version"]
    assert project.record()["stages"]["train"]["reason"] == "dep changed: data/raw"
    champion_model = (project.root / better["stored"]).read_text()
    assert json.loads(champion_model)["rows"] == 5
    # the spec's model files are kept at their project paths under the champion's folder, with their version
    kept = f"models/champions/{better['run_id']}/models/stack.json"
    assert better["files"] == {"stack": kept} and (project.root / kept).read_text() == champion_model
    assert better["version"] == version_of({"stack": project.root / kept}) != first["version"]
    assert "# toy retraining: promoted" in artifacts(project, better_id)["conveyor-promotion"]

    # Worse: not promoted (the model was not retrained: nothing it depends on changed).
    set_params(project, auc=0.85)
    _, book = retrain()
    assert book["champion"] == better
    assert book["history"][-1]["status"] == "rejected"
    assert book["history"][-1]["reason"].startswith("not better: stack.auc 0.85 vs champion 0.9")
    assert project.record()["stages"]["train"]["status"] == "skipped"

    # Better, but by less than the margin asked for in this run: not promoted.
    set_params(project, auc=0.95)
    _, book = retrain("min_delta=0.2")
    assert book["champion"] == better
    assert "less than min_delta 0.2" in book["history"][-1]["reason"]

    # A failed run: the champion stays, although the metrics file left by the last run beats it.
    set_params(project, auc=0.95, train_fails=True)
    failed_id, book = retrain(completed=False)
    assert book["champion"] == better
    assert book["history"][-1]["status"] == "failed"
    assert book["history"][-1]["reason"] == "the run failed (train): nothing to compare"
    assert (project.root / better["stored"]).read_text() == champion_model
    assert "run failed, champion kept" in artifacts(project, failed_id)["conveyor-promotion"]
    assert [c["status"] for c in book["history"]] == ["promoted", "promoted", "rejected", "rejected", "failed"]
    set_params(project, auc=0.95)

    # predict scores with the champion, not with the project's own (newer) model out
    out = project.root / "models/stack.json"
    own = out.read_text()
    out.write_text(json.dumps({"rows": 99}))
    (project.root / "rows.csv").write_text("x\n1\n2\n")
    scored = project.conveyor("predict", "-i", "rows.csv", "-o", "scores.parquet", "--workers", "1")
    out.write_text(own)
    assert scored.returncode == 0, scored.stderr
    assert f"with model {better['version']} (champion)" in scored.stdout
    assert pd.read_parquet(project.root / "scores.parquet")["score"].tolist() == [5.0, 5.0]


@pytest.mark.slow
def test_deployment_parameters_that_fail_validation_are_rejected_before_anything_runs(served: Served) -> None:
    project = served.project
    runs_before = len(deployment_runs(project, PIPELINE))

    # Mistyped: the server refuses to create the run (the deployments enforce their parameter schema).
    done = prefect(project, "deployment", "run", PIPELINE, "--param", "force=maybe")
    assert done.returncode == 1
    assert "Validation failed for field 'force'" in done.stdout and "'maybe' is not of type 'boolean'" in done.stdout
    done = prefect(project, "deployment", "run", RETRAIN, "--param", "direction=up")
    assert done.returncode == 1
    assert "'up' is not one of ['max', 'min']" in done.stdout
    assert len(deployment_runs(project, PIPELINE)) == runs_before

    # Well typed but not in the spec: the flow run fails with conveyor's message before any stage runs.
    latest = project.root / ".conveyor/runs/latest.json"
    before = latest.read_text() if latest.exists() else None
    book = project.root / "models/registry.json"
    book_before = book.read_text() if book.exists() else None
    for name, param, message in [
        (PIPELINE, 'stages=["trian"]', "unknown stage(s): trian (did you mean 'train'?)"),
        (PIPELINE, 'set_params=["train.dept=4"]', "params.yaml has no key 'train.dept' (did you mean 'train.depth'?)"),
        (RETRAIN, "metric=metrics/nope.json:auc",
         "metric file 'metrics/nope.json' is not written by any stage of configs/pipeline.yaml"),
    ]:
        flow_run_id = deployment_run(project, name, param)
        run = wait_final(project, flow_run_id)
        assert run.state.is_failed()
        assert message in run.state.message
        assert task_runs(project, flow_run_id) == []
    assert (latest.read_text() if latest.exists() else None) == before
    assert (book.read_text() if book.exists() else None) == book_before


STUCK_SPEC = """
pipeline: stuck
stages:
  block: {task: tasks.stuck:block, outs: [data/blocked.txt], timeout_s: 2}
"""

STUCK_TASK = """
import time


def block(ctx):
    ctx.outs["data/blocked.txt"].write_text("new")
    (ctx.root / "block.started").touch()
    time.sleep(600)  # one C call: the timeout cannot land in it
"""


@pytest.mark.slow
def test_a_deployment_run_whose_stage_is_abandoned_at_its_timeout_ends_its_process(served: Served) -> None:
    """The flow run fails at the stage's timeout, and its process (the runner's child) exits then,
    not when the C call the stage is blocked in returns."""
    project = served.project
    project.write("configs/stuck.yaml", STUCK_SPEC)
    project.write("tasks/stuck.py", STUCK_TASK)
    project.write("data/blocked.txt", "old")
    flow_run_id = deployment_run(project, PIPELINE, "spec=configs/stuck.yaml")

    def flow_run_process() -> psutil.Process | None:
        for child in psutil.Process(served.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                    return child
        return None

    deadline = time.monotonic() + RUN_DEADLINE_S
    while (process := flow_run_process()) is None:
        assert time.monotonic() < deadline, f"no process runs flow run {flow_run_id}:\n{served.log.read_text()[-3000:]}"
        time.sleep(0.1)
    run = wait_final(project, flow_run_id)
    assert run.state.is_failed(), run.state.message
    assert "timed out after 2s" in project.record()["stages"]["block"]["error"]
    assert (project.root / "data/blocked.txt").read_text() == "old"  # put back when it was abandoned
    try:
        process.wait(timeout=30)
    except psutil.TimeoutExpired:
        pytest.fail(f"the flow run's process still runs 30 s after the run failed: {process.cmdline()}")
    # and Prefect has the run's last log lines
    assert any(line.startswith("Finished in state Failed") for line in flow_run_logs(project, flow_run_id))


# ---------------------------------------------------------------- the retraining checks, without a server


@pytest.fixture
def toy_project(tmp_path: Path) -> Any:
    from conveyor.spec.project import load_project

    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    toy(Project(root, dict(os.environ)))
    return load_project(root / "configs/pipeline.yaml")


@pytest.mark.parametrize(("change", "message"), [
    ({"ingest": ["ingets"]}, r"unknown stage\(s\): ingets \(did you mean 'ingest'\?\); stages: ingest, train"),
    ({"metric": "metrics/test.json"}, r"metric 'metrics/test\.json': write it as FILE:KEY"),
    ({"metric": "metrics/other.json:auc"}, r"metric file 'metrics/other\.json' is not written by any stage of "
                                           r"configs/pipeline\.yaml \(outs and metrics: data/raw, models/stack\.json"),
    ({"model": "models/xgb.json"}, r"model 'models/xgb\.json' is not written by any stage"),
    ({"registry": "data/raw/registry.json"}, r"registry 'data/raw/registry\.json' overlaps the out data/raw"),
    ({"registry": "../registry.json"}, r"registry '\.\./registry\.json' must be a path inside the project"),
    ({"direction": "up"}, r"direction 'up': use max"),
    ({"profile": {"io": "gpu"}}, r"unknown profile 'gpu'"),
])
def test_retrain_parameters_are_checked_against_the_spec(toy_project: Any, change: dict[str, Any],
                                                         message: str) -> None:
    from conveyor.errors import ConveyorError
    from conveyor.prefect.retrain import retrain_plan

    params: dict[str, Any] = {"ingest": ["ingest"], "metric": "metrics/test.json:stack.auc", "direction": "max",
                              "min_delta": 0.0, "model": "models/stack.json", "registry": "models/registry.json",
                              **change}
    with pytest.raises(ConveyorError, match=message):
        retrain_plan(toy_project, **params)


def test_retrain_forces_the_source_stages_by_default(toy_project: Any) -> None:
    from conveyor.prefect.retrain import retrain_plan

    plan = retrain_plan(toy_project, ingest=None, metric="metrics/test.json:stack.auc", direction="min",
                        min_delta=0.5, model="models/stack.json", registry="models/registry.json")
    assert plan.options.forced == ("ingest",)
    assert (plan.rule.direction, plan.rule.min_delta, str(plan.rule.metric)) == ("min", 0.5,
                                                                                "metrics/test.json:stack.auc")
