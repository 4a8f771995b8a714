"""unshared-disk: what a stage costs on a Dask worker that does not see the project's disk, its data
moving through a local-directory DVC remote, against the same stage run locally.

The stage (a ``cmd``, the same script on both sides) reads one big dep, ``data/big.bin`` (1 GiB of
random bytes; ``--quick``: 128 MiB), and writes its md5 to ``out/digest.txt``: the cost of the
stage itself is one read of the dep, so what the candidate adds is all data movement.

- Baseline: ``conveyor run --force`` of a project whose stage has no ``on:`` (it runs where the
  runner is, reading the dep in place).
- Candidate: ``conveyor run --force`` of a copy of that project whose stage is ``on: remote``, a
  profile pointed at a ``dask scheduler`` and one ``dask worker`` started here, each in a mount
  namespace of its own where the project's directory is an empty tmpfs (``unshare -m``: needs
  root). The project's default DVC remote is a folder both see. Each repetition runs it twice:
  with the remote emptied before the run, so that it pays for the whole trip (the runner hashes
  the dep and copies it into the remote, the worker copies it into its scratch directory, runs
  the stage, stores the out; the runner checks the out out and records it), then again with the
  dep already in the remote (what every run after the first pays while the dep is unchanged),
  and a third time so, with the project's ``cache.type`` set to ``hardlink`` (the worker links the
  remote's read-only object into its scratch directory instead of copying it). Last, the same
  stage on a worker of a second cluster that sees the project's directory (no data moves): what
  the cluster itself costs the stage, against which the remote's share can be told.

Both projects are git + DVC repositories (the record: dvc.lock and DVC's cache, compiled from the
spec). The figure is the stage's wall as the run record gives it (``duration_s``: from the stage's
start to its record in dvc.lock), and the whole command's wall. Goal (issue 36): the candidate's
stage at most 1.5x the local stage's wall.

Checked before reporting: both sides' runs exited 0, their digests equal the md5 of the dep
computed here, the record says the stage succeeded on the expected profile, ``dvc status`` is
clean after each run, and the worker holds no scratch directory after a candidate run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.projects import base_env, cli, conveyor_command, make_repo, run_record, timed_cli

NAME = "unshared-disk"
DESCRIPTION = ("a stage reading a 1 GiB dep on a Dask worker without the project's disk (data through a "
               "local-directory DVC remote) vs the same stage run locally")
FULL_SIZE, QUICK_SIZE = 2**30, 128 * 2**20
GOAL = 1.5  # the candidate's stage wall at most this many times the local stage's

DIGEST = '''\
import hashlib
import sys
from pathlib import Path

digest = hashlib.md5()
with open(sys.argv[1], "rb") as fh:
    while block := fh.read(8 << 20):
        digest.update(block)
Path(sys.argv[2]).parent.mkdir(parents=True, exist_ok=True)
Path(sys.argv[2]).write_text(digest.hexdigest() + "\\n")
'''

SPEC = """\
pipeline: unshared-disk
profiles:
  remote: {{kind: dask, address: "{address}"}}
stages:
  digest:
    cmd: python scripts/digest.py data/big.bin out/digest.txt
{on}    deps: [data/big.bin, scripts/digest.py]
    outs: [out/digest.txt]
"""


def _write_big(path: Path, size: int) -> str:
    """``size`` random bytes at ``path``; their md5."""
    digest = hashlib.md5()  # DVC's hash
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        left = size
        while left:
            block = os.urandom(min(left, 8 << 20))
            fh.write(block)
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _project(root: Path, address: str, on: str, store: Path, big: Path) -> None:
    make_repo(root, {"pyproject.toml": "[project]\nname = 'bench'\n", "scripts/digest.py": DIGEST,
                     "configs/pipeline.yaml": SPEC.format(address=address, on=on),
                     ".gitignore": "/.conveyor/\n/data/\n"}, dvc=True)
    env = base_env()
    cli(["dvc", "config", "core.analytics", "false"], root, env)
    cli(["dvc", "remote", "add", "-d", "store", str(store)], root, env)
    (root / "data").mkdir()
    os.link(big, root / "data/big.bin")  # the same bytes on both sides, written once
    cli([conveyor_command(), "compile"], root, env)  # dvc.yaml: DVC's dvc.lock and cache are the record


def _hidden(root: Path, argv: list[str]) -> list[str]:
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{root}" && exec "$@"', "hidden", *argv]


@contextmanager
def _cluster(hidden: Path | None, where: Path) -> Iterator[str]:
    """A scheduler and one worker that see an empty folder at ``hidden`` (None: they see everything); their
    address."""
    from distributed import Client
    from distributed.utils import open_port

    port = open_port("127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in base_env().items() if k != "PYTHONPATH"}
    argvs = [["dask", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0"],
             ["dask", "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", ":0"]]
    procs = [subprocess.Popen(_hidden(hidden, argv) if hidden else argv, cwd=where, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for argv in argvs]
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(1, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)


def _scratch_on_worker(address: str) -> int:
    from distributed import Client

    def count(dask_worker: Any) -> int:
        places = [dask_worker.local_directory, tempfile.gettempdir()]
        return sum(name.startswith("conveyor-scratch-") for place in places for name in os.listdir(place))

    with Client(address) as client:
        return sum(client.run(count).values())


def _one_run(root: Path, profile: str, md5: str, before: Callable[[], None]) -> tuple[float, float]:
    """``conveyor run --force`` in ``root``: the stage's wall (the record's) and the command's."""
    before()
    done = timed_cli([conveyor_command(), "run", "--force"], root, base_env())
    stage = run_record(root)["stages"]["digest"]
    check(stage["status"] == "succeeded" and stage["profile"] == profile,
          f"{root.name}: digest {stage['status']} on {stage['profile']}")
    check((root / "out/digest.txt").read_text() == md5 + "\n", f"{root.name}: the digest is not the dep's md5")
    status = cli(["dvc", "status", "--json"], root, base_env()).stdout
    check(json.loads(status) == {}, f"{root.name}: dvc status after the run: {status}")
    locked = (root / "dvc.lock").read_text()
    check(md5 in locked, f"{root.name}: dvc.lock does not hold the dep's md5")
    return float(stage["duration_s"]), done.seconds


def run(config: Config, log: Callable[[str], None]) -> Result:
    check(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare(1)")
    size = QUICK_SIZE if config.quick else FULL_SIZE
    repeats = config.reps(3, 2)
    with tempfile.TemporaryDirectory(prefix="conveyor-unshared-") as scratch:
        base = Path(scratch)
        big = base / "big.bin"
        log(f"  writing {size / 2**20:.0f} MiB of random bytes")
        md5 = _write_big(big, size)
        local, hidden, store = base / "local", base / "hidden", base / "store"
        away = hidden / "project"
        hidden.mkdir()
        with _cluster(hidden, base) as address, _cluster(None, base) as seeing_address:
            _project(local, address, "", base / "unused-store", big)
            _project(away, address, "    on: remote\n", store, big)
            shared = base / "shared"
            _project(shared, seeing_address, "    on: remote\n", base / "unused-store", big)

            def empty_store() -> None:
                shutil.rmtree(store, ignore_errors=True)

            def candidate(_i: int) -> tuple[float, float, float, float, float]:
                cold = _one_run(away, "remote", md5, empty_store)
                check(_scratch_on_worker(address) == 0, "a scratch directory stayed on the worker")
                warm = _one_run(away, "remote", md5, lambda: None)
                check(_scratch_on_worker(address) == 0, "a scratch directory stayed on the worker")
                cli(["dvc", "config", "cache.type", "hardlink"], away, base_env())
                try:
                    linked = _one_run(away, "remote", md5, lambda: None)
                finally:
                    cli(["dvc", "config", "--unset", "cache.type"], away, base_env())
                check(_scratch_on_worker(address) == 0, "a scratch directory stayed on the worker")
                on_shared = _one_run(shared, "remote", md5, lambda: None)
                return cold[0], cold[1], warm[0], linked[0], on_shared[0]

            baseline_runs, candidate_runs = interleaved(
                repeats, lambda _i: _one_run(local, "local", md5, lambda: None), candidate, log)
    stage = Metric("stage wall (s), remote emptied", [b[0] for b in baseline_runs], [c[0] for c in candidate_runs])
    there = Metric("stage wall (s), dep in the remote", [b[0] for b in baseline_runs], [c[2] for c in candidate_runs])
    linked = Metric("the same, `cache.type: hardlink`", [b[0] for b in baseline_runs],
                    [c[3] for c in candidate_runs])
    seeing = Metric("stage wall (s) on a worker that sees the project", [b[0] for b in baseline_runs],
                    [c[4] for c in candidate_runs])
    whole = Metric("`conveyor run` wall (s), remote emptied", [b[1] for b in baseline_runs],
                   [c[1] for c in candidate_runs])
    share, warm_share, linked_share = stage.share(), there.share(), linked.share()
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="the stage run locally (no `on:`), reading the dep in place",
        candidate="the stage on a Dask worker in its own mount namespace (the project's directory an empty "
                  "tmpfs), deps and outs through a local-directory DVC remote",
        repeats=repeats, metrics=[stage, there, linked, seeing, whole],
        setup={"dep": f"{size / 2**20:.0f} MiB of random bytes", "stage": "md5 of the dep into out/digest.txt",
               "cluster": "dask scheduler + 1 worker (1 thread) on 127.0.0.1, each `unshare -m`'d"},
        checks=["every run exited 0; its digest is the dep's md5; its record says digest succeeded on the "
                "expected profile; `dvc status` clean after it", "no scratch directory on the worker after a run"],
        notes=[f"candidate stage wall / local stage wall: median {share:.2f} with the remote emptied before the run, "
               f"{warm_share:.2f} with the dep already there, {linked_share:.2f} with the dep there and the project's "
               f"cache.type hardlink (goal <= {GOAL}: {met(share <= GOAL)} emptied, {met(warm_share <= GOAL)} "
               f"there, {met(linked_share <= GOAL)} hardlinked)",
               f"median stage walls: local {median(stage.baseline):.2f} s, through the remote "
               f"{median(stage.candidate):.2f} s (emptied), {median(there.candidate):.2f} s (dep there), "
               f"{median(linked.candidate):.2f} s (hardlinked); on a worker of a cluster that sees the project (what "
               f"a cluster costs without moving data) {median(seeing.candidate):.2f} s"],
    )
