"""unshared-disk: a stage on a Dask worker that does not see the project's disk, its data moving through a
local-directory DVC remote, against the same stage run locally.

A ``cmd`` stage writes the md5 of a 1 GiB dep (``--quick``: 128 MiB), locally or ``on:`` a worker in a mount namespace
where the project is an empty tmpfs (``unshare -m``: root). Goal (issue 36): <= 1.5x the local stage. Checked: each
run's digest is the dep's md5 (in dvc.lock too) on the expected profile, `dvc status` clean, no scratch left."""

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.dvc import dvc_status
from benchmarks.harness import Config, Metric, Result, check, interleaved, met, scratch
from benchmarks.projects import base_env, cli, make_repo, run_record, timed_cli

NAME = "unshared-disk"
DESCRIPTION = ("a stage reading a 1 GiB dep on a Dask worker without the project's disk (data through a "
               "local-directory DVC remote) vs the same stage run locally")
GOAL = 1.5
DIGEST = ("import hashlib, sys\nfrom pathlib import Path\nout = Path(sys.argv[2])\nout.parent.mkdir(exist_ok=True)\n"
          "out.write_text(hashlib.file_digest(open(sys.argv[1], 'rb'), 'md5').hexdigest() + '\\n')\n")
SPEC = """\
pipeline: unshared-disk
profiles: {{remote: {{kind: dask, address: "{address}"}}}}
stages:
  digest: {{cmd: python scripts/digest.py data/big.bin out/digest.txt, {on}deps: [data/big.bin, scripts/digest.py],
           outs: [out/digest.txt]}}
"""
ROWS = {"stage wall (s), remote emptied": ("emptied", 0), "stage wall (s), dep in the remote": ("there", 0),
        "the same, `cache.type: hardlink`": ("hardlinked", 0), "stage wall (s) on a worker that sees the project":
        ("seeing", 0), "`conveyor run` wall (s), remote emptied": ("emptied", 1)}  # label: the run, stage or command


def _project(root: Path, address: str, on: str, store: Path, big: Path) -> None:
    make_repo(root, {"pyproject.toml": "[project]\nname = 'bench'\n", "scripts/digest.py": DIGEST,
                     "configs/pipeline.yaml": SPEC.format(address=address, on=on),
                     ".gitignore": "/.conveyor/\n/data/\n"}, dvc=True)
    for args in (["config", "core.analytics", "false"], ["remote", "add", "-d", "store", str(store)]):
        cli(["dvc", *args], root, base_env())
    (root / "data").mkdir()
    os.link(big, root / "data/big.bin")  # the same bytes on both sides, written once
    cli(["conveyor", "compile"], root, base_env())  # dvc.yaml: DVC's dvc.lock and cache are the record


@contextmanager
def _cluster(hidden: Path | None, where: Path) -> Iterator[str]:
    """A scheduler and a worker seeing an empty tmpfs at ``hidden`` (None: everything); their address."""
    from distributed import Client
    from distributed.utils import open_port
    address = f"tcp://127.0.0.1:{(port := open_port('127.0.0.1'))}"
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


def _one_run(root: Path, profile: str, md5: str, address: str | None = None) -> tuple[float, float]:
    """``conveyor run --force`` in ``root``, checked: the stage's wall (the record's) and the command's."""
    from distributed import Client
    done = timed_cli(["conveyor", "run", "--force"], root, base_env())
    stage = run_record(root)["stages"]["digest"]
    check(stage["status"] == "succeeded" and stage["profile"] == profile,
          f"{root.name}: digest {stage['status']} on {stage['profile']}")
    check((root / "out/digest.txt").read_text() == md5 + "\n", f"{root.name}: the digest is not the dep's md5")
    dvc_status(root, base_env(), "after the run")
    check(md5 in (root / "dvc.lock").read_text(), f"{root.name}: dvc.lock does not hold the dep's md5")
    if address:  # no scratch directory stays on the worker
        with Client(address) as client:
            left = client.run(lambda dask_worker: sum(name.startswith("conveyor-scratch-") for place in (
                dask_worker.local_directory, tempfile.gettempdir()) for name in os.listdir(place)))
        check(sum(left.values()) == 0, "a scratch directory stayed on the worker")
    return float(stage["duration_s"]), done.seconds


def run(config: Config, log: Callable[[str], None]) -> Result:
    check(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare(1)")
    size, repeats = 128 * 2**20 if config.quick else 2**30, config.reps(3, 2)
    with scratch(NAME) as base:
        big, local, hidden, store = base / "big.bin", base / "local", base / "hidden", base / "store"
        with big.open("wb") as fh:
            for _ in range(size >> 23):
                fh.write(os.urandom(8 << 20))
        with big.open("rb") as read:
            md5, away, shared = hashlib.file_digest(read, "md5").hexdigest(), hidden / "project", base / "shared"
        hidden.mkdir()
        with _cluster(hidden, base) as address, _cluster(None, base) as seeing_address:
            _project(local, address, "", base / "unused-store", big)
            _project(away, address, "on: remote, ", store, big)
            _project(shared, seeing_address, "on: remote, ", base / "unused-store", big)

            def candidate(_i: int) -> dict[str, tuple[float, float]]:
                shutil.rmtree(store, ignore_errors=True)
                runs = {key: _one_run(away, "remote", md5, address) for key in ("emptied", "there")}
                cli(["dvc", "config", "cache.type", "hardlink"], away, base_env())
                runs["hardlinked"] = _one_run(away, "remote", md5, address)
                cli(["dvc", "config", "--unset", "cache.type"], away, base_env())
                return {**runs, "seeing": _one_run(shared, "remote", md5)}
            local_runs, cand = interleaved(repeats, lambda _i: _one_run(local, "local", md5), candidate, log)
    metrics = [Metric(label, [b[i] for b in local_runs], [c[key][i] for c in cand]) for label, (key, i) in ROWS.items()]
    shares = [m.share() for m in metrics[:3]]
    return Result(
        NAME, DESCRIPTION, "the stage run locally (no `on:`), reading the dep in place", "the stage on a Dask worker "
        "in a mount namespace of its own (the project an empty tmpfs), deps and outs through a local-directory DVC "
        "remote", repeats, metrics, setup={"dep": f"{size / 2**20:.0f} MiB of random bytes"},
        notes=["candidate stage wall / local stage wall: median {:.2f} with the remote emptied before the run, {:.2f} "
               "with the dep already there, {:.2f} with the dep there and the project's cache.type hardlink (goal <= "
               "{}: {} emptied, {} there, {} hardlinked)".format(*shares, GOAL, *(met(x <= GOAL) for x in shares))])
