"""Deterministic tasks forked by a warm runner of their pinned environment.

A ``deterministic: true`` task needs a process whose libraries load with its pins
(:mod:`conveyor.run.determinism`), so it runs in one of its own (:mod:`conveyor.run.isolated`),
which imported torch, scikit-learn or XGBoost anew each time: 2 to 3 s of every such stage. In a
run of the command line (``run``, ``exec``, ``search``: :func:`hand_tasks_over`) that process is
instead a stand-in (:func:`task`, started by the stage as before, under its guard: killed with the
run, on Ctrl-C, at its timeout) that hands the task to a warm runner started with that pinned
environment (:mod:`conveyor.cli.warm_runner`, which imports no Prefect nor DVC for it and learns
the tasks' libraries as it learns a run's), exactly as ``conveyor`` hands a run over: the child is
the task's process, the stand-in forwards its signals and exits as it does. The run starts that
runner itself (:func:`task_start`), before the stage: started from under the stage's guard, a
subreaper that ends what its commands leave, it would end with the stage. Where warm runners are
off, or none takes the task, the stand-in runs it itself, as before.

The runner's key and environment are the task's less what the run set in its own process (the
Prefect server's address and its client's bounds, what a library set as it loaded, such as
scikit-learn's ``KMP_*``): those would give every run, or every kept server, a runner of its own;
the task gets them all the same (its client's environment).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping

from conveyor.cli.warm import (
    ANEW,
    STARTED_WITH,
    TASK,
    eligible,
    handed_over,
    lasting_environ,
    serving,
    standard_fds_open,
    start_runner,
)

_STARTED: set[str] = set()  # the environments whose task runner this process has started or found up


def hand_tasks_over() -> None:
    """This command's deterministic tasks start as :func:`task_start` says."""
    from conveyor.run import isolated

    isolated.STARTERS[:] = [task_start]


def task_start(stage_env: Mapping[str, str]) -> list[str]:
    """How a deterministic stage's task starts (``conveyor.run.isolated.STARTERS``): the runner of its
    environment (``stage_env``, its pins among it, over this process's) started, unless one is up or warm
    runners are off, and the command that hands the task to it (:func:`task`; the payload's path follows)."""
    from conveyor.run.nanny_env import user_environ

    changed = {k for k in {*os.environ, *STARTED_WITH} if os.environ.get(k) != STARTED_WITH.get(k)} \
        if STARTED_WITH else set()  # not started as `conveyor` (typer's CliRunner): what it set is not known
    leave = changed - set(stage_env)
    if serving():
        lasting = lasting_environ({**user_environ(), **stage_env}, leave, keep=set(stage_env))  # its pins kept
        wanted = hashlib.sha256(json.dumps(sorted(lasting.items())).encode()).hexdigest()
        if wanted not in _STARTED and _start_task_runner(lasting):
            _STARTED.add(wanted)  # not asked again (one that has gone since: its tasks run by themselves)
    return [sys.executable, "-P", "-c", "from conveyor.cli.warm_task import task; task()", ",".join(sorted(leave))]


def _start_task_runner(env: dict[str, str]) -> bool:
    """Start the runner that :func:`task` run with ``env`` hands itself to (it ends at once where one is up):
    it works out its own key, as the task will, in a process started as the task's is (``-P``: ``sys.path``
    without the working directory); True once it listens, or has ended."""
    code = ("import sys; from conveyor.cli.warm import key; from conveyor.cli.warm_runner import serve; "
            "serve(key(), int(sys.argv[1]), task=True)")
    return start_runner([sys.executable, "-P", "-c", code], env)


def task() -> None:
    """``python -P -c 'from conveyor.cli.warm_task import task; task()' LEAVE PAYLOAD``: hand the task of
    PAYLOAD to the runner of this environment less the variables LEAVE names, and end as its child does;
    where none takes it, run it here."""
    anew = os.environ.pop(ANEW, "")  # a runner's child that could not be the task: it is, fresh
    leave, payload = sys.argv[1:3]
    found = eligible([TASK], frozenset(leave.split(","))) if standard_fds_open() and not anew else None
    if found is not None:
        handed_over(found, [TASK, leave, payload])  # returns only when no runner took it
    from conveyor.run.isolated import main as run_here

    sys.exit(run_here([TASK, payload]))
