"""A dask profile's ``in_process_below``: a stage whose deps are smaller runs in the runner's own
process (no worker started for it), a bigger one on the profile's workers; the record, the
summary and the stage's log say which, and why."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from projects import Project

pytestmark = pytest.mark.slow

TASKS = '''
import json, os


def where(ctx):
    computed_in = ctx.client.submit(os.getpid, pure=False).result() if ctx.client is not None else None
    ctx.out().write_text(json.dumps({"client": ctx.client is not None, "computed_in": computed_in}))
'''


def test_small_deps_run_in_process_big_ones_on_the_workers_and_the_record_says_why(
    make_project: Callable[[], Project],
) -> None:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    (project.root / "data").mkdir()
    (project.root / "data/small.bin").write_bytes(b"s" * 1024)
    (project.root / "data/big.bin").write_bytes(b"b" * 20 * 1024)
    project.write("configs/pipeline.yaml", """
        pipeline: placement
        profiles:
          cpu: {kind: dask, n_workers: 1, threads_per_worker: 1, memory_limit: 1GiB, in_process_below: 10KiB}
        stages:
          small: {task: tasks.steps:where, on: cpu, deps: [data/small.bin], outs: [out/small.json]}
          big: {task: tasks.steps:where, on: cpu, deps: [data/big.bin], outs: [out/big.json]}
          shell: {cmd: "echo ran > out/shell.txt", on: cpu, deps: [data/small.bin], outs: [out/shell.txt]}
        """)

    proc = project.popen("run")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output

    small, big = (json.loads((project.root / f"out/{s}.json").read_text()) for s in ("small", "big"))
    assert small == {"client": False, "computed_in": None}  # no cluster: dask computes in conveyor's process
    assert big["client"] and big["computed_in"] != proc.pid  # on a Dask worker
    assert (project.root / "out/shell.txt").read_text() == "ran\n"

    stages = project.record()["stages"]
    in_process = "in process: its deps hold 1.0 KiB, under the in_process_below of profile 'cpu' (10KiB)"
    assert stages["small"]["placement"] == stages["shell"]["placement"] == in_process
    assert stages["big"]["placement"] == ("on the workers of profile 'cpu': its deps hold at least its "
                                          "in_process_below (10KiB)")
    assert {s["profile"] for s in stages.values()} == {"cpu"}
    assert output.count("cpu (in process)") >= 2  # the summary's profile column
    log = project.conveyor("logs", "small")
    assert f"runs {in_process}" in log.stdout
    assert not project.left_running(), "a Dask worker outlived the run"
