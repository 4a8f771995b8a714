"""A stage runs its code as it is, whenever it was edited: never Python's bytecode of the version before."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

from projects import Project

SPEC = """
    pipeline: edits
    stages:
      task: {task: tasks.work:write, outs: [data/task.txt]}
      command:
        cmd: python scripts/show.py data/command.txt
        deps: [scripts/show.py, scripts/helper.py]
        outs: [data/command.txt]
"""
WORK = """
    from tasks import helpers


    def write(ctx):
        ctx.out().write_text(helpers.VALUE)
"""
SHOW = """
    import sys
    from pathlib import Path

    import helper

    Path(sys.argv[1]).write_text(helper.VALUE)
"""


def _at(path: Path, second: int, fraction: float) -> None:
    ns = second * 1_000_000_000 + int(fraction * 1_000_000_000)
    os.utime(path, ns=(ns, ns))


def test_an_edit_in_the_second_a_run_compiled_the_code_in_runs(make_project: Callable[[], Project]) -> None:
    """A task's module and a script's module edited, the size kept, in the second of the version the
    last run compiled (a script's edit just after a sub-second run): the next run runs the edit."""
    project = make_project()
    project.write("configs/pipeline.yaml", SPEC)
    project.write("tasks/__init__.py", "")
    project.write("tasks/work.py", WORK)
    project.write("scripts/show.py", SHOW)
    modules = [project.write(module, "VALUE = 'v1'\n") for module in ("tasks/helpers.py", "scripts/helper.py")]
    second = int(time.time()) - 100
    for module in modules:
        _at(module, second, 0.1)
    first = project.conveyor("run")
    assert first.returncode == 0, first.stdout + first.stderr
    assert [(project.root / f"data/{s}.txt").read_text() for s in ("task", "command")] == ["v1", "v1"]

    for module in modules:
        cached = Path(importlib.util.cache_from_source(str(module)))
        assert cached.is_file(), f"the first run compiled no {cached}"
        _at(cached, second, 0.4)  # as a run in that very second wrote it
        module.write_text("VALUE = 'v2'\n")
        _at(module, second, 0.7)
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert [(project.root / f"data/{s}.txt").read_text() for s in ("task", "command")] == ["v2", "v2"]
