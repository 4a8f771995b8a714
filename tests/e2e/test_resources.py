"""A stage's ``resources:`` ({GPU: 1}) hold whole Dask workers that declare them, on CPU workers
declaring GPU resources: the items of a sweep never share one, and an xgboost.dask stage asking for
two runs on exactly two of three workers while another stage uses the third."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

import pytest
from projects import Project

pytestmark = pytest.mark.slow

TASKS = '''
import json

import dask.dataframe as dd
import numpy as np
import pandas as pd

from conveyor.train.xgb import train_xgboost


def fit(ctx):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"x": rng.normal(size=400), "z": rng.normal(size=400)})
    frame["y"] = (frame["x"] > 0).astype(int)
    trained = train_xgboost(ctx.client, {"objective": "binary:logistic", "tree_method": "hist"},
                            dd.from_pandas(frame, npartitions=4), label="y", num_boost_round=5)
    ctx.metric().write_text(json.dumps({"n_workers": trained.n_workers, "ctx_workers": ctx.n_workers}))
'''

SPEC = """
pipeline: held
profiles:
  gpus: {kind: dask, n_workers: 3, threads_per_worker: 2, memory_limit: 1GiB, resources: {GPU: 1}}
stages:
  sweep:
    cmd: sleep 0.4 && echo ${item.n} > runs/${key}.txt
    on: gpus
    resources: {GPU: 1}
    matrix:
      n: [1, 2, 3, 4, 5]
    outs: ['runs/${key}.txt']
  fit:
    task: tasks.steps:fit
    on: gpus
    resources: {GPU: 2}
    metrics: [metrics/fit.json]
"""


def held_project(make_project: Callable[[], Project], spec: str = SPEC) -> Project:
    project = make_project()
    project.write("configs/pipeline.yaml", spec)
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    (project.root / "runs").mkdir()
    return project


def test_stages_hold_the_workers_their_resources_need_and_never_share_a_unit(
        make_project: Callable[[], Project]) -> None:
    project = held_project(make_project)
    done = project.conveyor("run")
    assert done.returncode == 0, done.stdout + done.stderr
    stages = project.record()["stages"]
    assert {s["status"] for s in stages.values()} == {"succeeded"}

    fit = json.loads((project.root / "metrics/fit.json").read_text())
    assert fit == {"n_workers": 2, "ctx_workers": 2}  # xgboost.dask trained on the two workers held
    assert len(stages["fit"]["held"]["workers"]) == 2

    spans: list[tuple[str, datetime, datetime, str]] = []
    for name, stage in stages.items():
        held = stage["held"]
        spans += [(worker, datetime.fromisoformat(held["from"]), datetime.fromisoformat(held["until"]), name)
                  for worker in held["workers"]]
    assert {worker for worker, *_ in spans} == {"0", "1", "2"}
    for worker, start, end, name in spans:  # one unit of GPU per worker: no two holds of it overlap
        for other, start2, end2, name2 in spans:
            if name2 != name and other == worker:
                assert end <= start2 or end2 <= start, f"{name} and {name2} held worker {worker} at once"
    sweep = [s for name, s in stages.items() if name.startswith("sweep@")]
    assert len(sweep) == 5 and all(len(s["held"]["workers"]) == 1 for s in sweep)
    assert sorted((project.root / "runs").iterdir()) == sorted(project.root / f"runs/{n}.txt" for n in range(1, 6))


def test_resources_no_worker_declares_fail_the_stage_in_one_line(make_project: Callable[[], Project]) -> None:
    project = held_project(make_project, """
        pipeline: short
        profiles:
          gpus: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB, resources: {GPU: 1}}
        stages:
          big: {cmd: echo big > big.txt, on: gpus, resources: {GPU: 2}, outs: [big.txt]}
    """)
    done = project.conveyor("run", timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    error = project.record()["stages"]["big"]["error"]
    assert "it needs GPU=2 on one worker, and the workers of profile 'gpus' declare GPU=1" in error
    assert not (project.root / "big.txt").exists()


def test_resources_without_dask_workers_are_a_spec_error(make_project: Callable[[], Project]) -> None:
    project = held_project(make_project, """
        pipeline: nowhere
        stages:
          one: {cmd: echo 1 > one.txt, resources: {GPU: 1}, outs: [one.txt]}
    """)
    done = project.conveyor("validate")
    assert done.returncode == 2
    assert "stages.one.resources: resources are held on Dask workers and it has no 'on:'" in done.stderr
