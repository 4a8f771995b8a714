"""unshared-disk: a stage on a Dask worker that does not see the project's disk, its data moving through a
local-directory DVC remote, against the same stage run locally.

The stage (a ``cmd``) writes the md5 of one big dep (1 GiB of random bytes; ``--quick``: 128 MiB) to
``out/digest.txt``: what the candidate adds is all data movement. Baseline: ``conveyor run --force`` with no
``on:``. Candidate: the stage ``on:`` a profile whose ``dask scheduler`` and worker run here in mount
namespaces where the project's directory is an empty tmpfs (``unshare -m``: needs root), the remote a folder
both see; each repetition runs it with the remote emptied first, with the dep already there, so again with
``cache.type hardlink``, and on a second cluster that sees the project (what the cluster alone costs). The
figure is the stage's ``duration_s`` in the run record. Checked: every run exits 0, its digest is the dep's
md5 (in dvc.lock too), its record names the expected profile, ``dvc status`` is clean, and no scratch
directory stays on the worker. Goal (issue 36): the candidate's stage <= 1.5x the local one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, interleaved, median, met
from benchmarks.projects import base_env, cli, conveyor_command, make_repo, run_record, timed_cli

NAME = "unshared-disk"
DESCRIPTION = ("a stage reading a 1 GiB dep on a Dask worker without the project's disk (data through a "
               "local-directory DVC remote) vs the same stage run locally")
GOAL = 1.5  # the candidate's stage wall at most this many times the local stage's
DIGEST = ("import hashlib, sys\nfrom pathlib import Path\ndigest = hashlib.md5()\nwith open(sys.argv[1], 'rb') as fh:\n"
          "    while block := fh.read(8 << 20):\n        digest.update(block)\n"
          "Path(sys.argv[2]).parent.mkdir(parents=True, exist_ok=True)\n"
          "Path(sys.argv[2]).write_text(digest.hexdigest() + '\\n')\n")
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
ROWS = {"stage wall (s), remote emptied": "emptied", "stage wall (s), dep in the remote": "there",
        "the same, `cache.type: hardlink`": "hardlinked", "stage wall (s) on a worker that sees the project": "seeing"}


def _project(root: Path, address: str, on: str, store: Path, big: Path) -> None:
    make_repo(root, {"pyproject.toml": "[project]\nname = 'bench'\n", "scripts/digest.py": DIGEST,
                     "configs/pipeline.yaml": SPEC.format(address=address, on=on),
                     ".gitignore": "/.conveyor/\n/data/\n"}, dvc=True)
    for args in (["config", "core.analytics", "false"], ["remote", "add", "-d", "store", str(store)]):
        cli(["dvc", *args], root, base_env())
    (root / "data").mkdir()
    os.link(big, root / "data/big.bin")  # the same bytes on both sides, written once
    cli([conveyor_command(), "compile"], root, base_env())  # dvc.yaml: DVC's dvc.lock and cache are the record


@contextmanager
def _cluster(hidden: Path | None, where: Path) -> Iterator[str]:
    """A scheduler and one worker that see an empty tmpfs at ``hidden`` (None: everything); their address."""
    from distributed import Client
    from distributed.utils import open_port

    port = open_port("127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    hide = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"',
            "hidden"] if hidden else []
    env = {k: v for k, v in base_env().items() if k != "PYTHONPATH"}
    procs = [subprocess.Popen([*hide, *argv], cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for argv in (
        ["dask", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0"],
        ["dask", "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", ":0"])]
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(1, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)


def _no_scratch_on(address: str) -> None:
    from distributed import Client

    def count(dask_worker: Any) -> int:
        return sum(name.startswith("conveyor-scratch-") for place in (dask_worker.local_directory,
                   tempfile.gettempdir()) for name in os.listdir(place))

    with Client(address) as client:
        check(sum(client.run(count).values()) == 0, "a scratch directory stayed on the worker")


def _one_run(root: Path, profile: str, md5: str) -> tuple[float, float]:
    """``conveyor run --force`` in ``root``, checked: the stage's wall (the record's) and the command's."""
    done = timed_cli([conveyor_command(), "run", "--force"], root, base_env())
    stage = run_record(root)["stages"]["digest"]
    check(stage["status"] == "succeeded" and stage["profile"] == profile,
          f"{root.name}: digest {stage['status']} on {stage['profile']}")
    check((root / "out/digest.txt").read_text() == md5 + "\n", f"{root.name}: the digest is not the dep's md5")
    dvc_status(root, base_env(), "after the run")
    check(md5 in (root / "dvc.lock").read_text(), f"{root.name}: dvc.lock does not hold the dep's md5")
    return float(stage["duration_s"]), done.seconds


def run(config: Config, log: Callable[[str], None]) -> Result:
    check(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare(1)")
    size, repeats = 128 * 2**20 if config.quick else 2**30, config.reps(3, 2)
    with tempfile.TemporaryDirectory(prefix="conveyor-unshared-") as scratch:
        base = Path(scratch)
        big, local, hidden, store = base / "big.bin", base / "local", base / "hidden", base / "store"
        log(f"  writing {size / 2**20:.0f} MiB of random bytes")
        digest = hashlib.md5()  # DVC's hash
        with big.open("wb") as fh:
            for block in (os.urandom(8 << 20) for _ in range(size >> 23)):
                fh.write(block)
                digest.update(block)
        md5 = digest.hexdigest()
        away, shared = hidden / "project", base / "shared"
        hidden.mkdir()
        with _cluster(hidden, base) as address, _cluster(None, base) as seeing_address:
            _project(local, address, "", base / "unused-store", big)
            _project(away, address, "    on: remote\n", store, big)
            _project(shared, seeing_address, "    on: remote\n", base / "unused-store", big)

            def candidate(_i: int) -> dict[str, tuple[float, float]]:
                shutil.rmtree(store, ignore_errors=True)
                runs = {"emptied": _one_run(away, "remote", md5)}
                _no_scratch_on(address)
                runs["there"] = _one_run(away, "remote", md5)
                _no_scratch_on(address)
                cli(["dvc", "config", "cache.type", "hardlink"], away, base_env())
                try:
                    runs["hardlinked"] = _one_run(away, "remote", md5)
                finally:
                    cli(["dvc", "config", "--unset", "cache.type"], away, base_env())
                _no_scratch_on(address)
                return {**runs, "seeing": _one_run(shared, "remote", md5)}

            local_runs, cand = interleaved(repeats, lambda _i: _one_run(local, "local", md5), candidate, log)
    metrics = [Metric(label, [b[0] for b in local_runs], [c[key][0] for c in cand]) for label, key in ROWS.items()]
    metrics.append(Metric("`conveyor run` wall (s), remote emptied", [b[1] for b in local_runs],
                          [c["emptied"][1] for c in cand]))
    shares = [m.share() for m in metrics[:3]]
    return Result(
        name=NAME, description=DESCRIPTION,
        baseline="the stage run locally (no `on:`), reading the dep in place",
        candidate="the stage on a Dask worker in its own mount namespace (the project's directory an empty "
                  "tmpfs), deps and outs through a local-directory DVC remote",
        repeats=repeats, metrics=metrics,
        setup={"dep": f"{size / 2**20:.0f} MiB of random bytes", "stage": "md5 of the dep into out/digest.txt",
               "cluster": "dask scheduler + 1 worker (1 thread) on 127.0.0.1, each `unshare -m`'d"},
        checks=["every run exited 0; its digest is the dep's md5; its record says digest succeeded on the "
                "expected profile; `dvc status` clean after it", "no scratch directory on the worker after a run"],
        notes=["candidate stage wall / local stage wall: median {:.2f} with the remote emptied before the run, {:.2f} "
               "with the dep already there, {:.2f} with the dep there and the project's cache.type hardlink".format(
                   *shares) + f" (goal <= {GOAL}: {met(shares[0] <= GOAL)} emptied, {met(shares[1] <= GOAL)} there, "
               f"{met(shares[2] <= GOAL)} hardlinked)",
               f"median stage walls: local {median(metrics[0].baseline):.2f} s, through the remote "
               + ", ".join(f"{median(m.candidate):.2f} s ({k})" for m, k in zip(metrics, ROWS.values(), strict=False))],
    )
