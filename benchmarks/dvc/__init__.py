"""conveyor beside `dvc repro` on the same dvc.yaml: parallel branches, sweeps, projects of thousands of stages."""

from collections.abc import Mapping
from pathlib import Path

from benchmarks.harness import check
from benchmarks.projects import cli, timed_cli


def dvc_status(root: Path, env: Mapping[str, str], when: str, *, timed: bool = False) -> float:
    """`dvc status` in ``root``, checked to say the pipeline is up to date; its seconds (hyperfine's) if ``timed``."""
    done = timed_cli(["dvc", "status"], root, env) if timed else None
    stdout = done.stdout if done else cli(["dvc", "status"], root, env).stdout
    check("Data and pipelines are up to date." in stdout, f"`dvc status` {when} is not clean:\n{stdout[-2000:]}")
    return done.seconds if done else 0.0
