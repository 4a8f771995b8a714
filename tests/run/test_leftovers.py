"""Which processes under a command count as its tasks' leftovers (conveyor.run.leftovers).

In a process of its own: the test process has children of its own (the session's Prefect server,
a Dask cluster) that a sweep of its own children would end.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conveyor.cli.warm import VOLATILE
from conveyor.run.leftovers import OUTLIVES

SWEEP = """
import json, multiprocessing.resource_tracker, os, subprocess, sys, time
import psutil
from conveyor.run.leftovers import end_leftovers, leftovers, outliving

NAP = "import time; time.sleep(600)"
PARENT = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]]); time.sleep(600)"

def child_of(proc):
    deadline = time.monotonic() + 30
    while not (found := psutil.Process(proc.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found[0]

multiprocessing.resource_tracker.ensure_running()  # a helper, ended by its own process's exit
from joblib import Parallel, delayed
Parallel(n_jobs=2)(delayed(abs)(i) for i in range(4))  # joblib's reusable workers, kept for the next call
kept = subprocess.Popen([sys.executable, "-c", PARENT, NAP], env=outliving(os.environ))
left = subprocess.Popen([sys.executable, "-c", PARENT, NAP])
kept_child, left_child = child_of(kept), child_of(left)
found = sorted(p.pid for p in leftovers())
ended = end_leftovers(grace_s=5)
print(json.dumps({"expected": sorted([left.pid, left_child.pid]), "found": found, "ended": ended,
                  "left_gone": [left.poll() is not None, not left_child.is_running()],
                  "kept_alive": [kept.poll() is None, kept_child.is_running()],
                  "tracker": multiprocessing.resource_tracker._resource_tracker._check_alive()}))
kept_child.kill()
kept.kill()
"""


def test_kept_processes_their_children_multiprocessing_helpers_and_joblib_workers_stay_the_rest_ends() -> None:
    done = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["found"] == seen["expected"]
    assert [int(line.split(" ")[0]) for line in seen["ended"]] == seen["expected"]
    assert seen["ended"][0].startswith(f"{seen['expected'][0]} (" + f"{sys.executable} -c import subprocess"[:60])
    assert seen["left_gone"] == [True, True] and seen["kept_alive"] == [True, True] and seen["tracker"]


def test_the_mark_of_a_kept_process_never_keys_a_warm_runner() -> None:
    """A warm runner is started with it, and a task runner keys itself by its own environment."""
    assert OUTLIVES in VOLATILE
