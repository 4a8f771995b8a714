"""Throwaway projects and repositories, commands run in them with or without a Prefect server, run records."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import commands
from benchmarks.harness import REPO, check, side_report
from benchmarks.processes import PrefectServer, leftovers

TIMEOUT_S = 600  # any one command


def stage(k: int) -> str:
    return f"s{k:02d}"


def out(k: int) -> str:
    return f"out/{stage(k)}.txt"


def chain_text(k: int) -> str:
    """What ``out/s<k>.txt`` holds on every side: the name of every stage up to ``k``, one a line."""
    return "".join(f"{stage(j)}\n" for j in range(k + 1))


def base_env() -> dict[str, str]:
    """This environment, this interpreter's bin folder (conveyor, dvc, python) first on PATH, writing bytecode as
    a user's Python does (with PYTHONDONTWRITEBYTECODE set every run would compile conveyor anew)."""
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
           "COLUMNS": "160"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def no_server_env(home: Path) -> dict[str, str]:
    """PREFECT_API_URL unset, a temporary PREFECT_HOME: no server unless the command starts one."""
    env = {**base_env(), "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    return env


def server_env(server: PrefectServer) -> dict[str, str]:
    """Pointed at the benchmark's own `prefect server start` (its temporary PREFECT_HOME)."""
    return {**base_env(), **{k: v for k, v in server.env.items() if k.startswith("PREFECT_")}}


def cli(args: Sequence[str], cwd: Path, env: Mapping[str, str],
        timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; CheckFailed unless it exits 0."""
    proc = subprocess.run(list(args), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    check(proc.returncode == 0, f"`{' '.join(args)}` in {cwd.name} exited {proc.returncode}:\n"
                                f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def timed_cli(args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float = TIMEOUT_S,
              *, memory: bool = False, strict: bool = True) -> commands.Timed:
    """The command timed by hyperfine (and its tree's peak RSS with ``memory``), checked to exit 0."""
    return commands.timed(args, cwd, env, timeout=timeout, memory=memory, strict=strict)


def repo_env() -> dict[str, str]:
    """This environment with the repository on PYTHONPATH: a ``python -c`` side imports ``benchmarks``, ``tasks``."""
    return {**base_env(), "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


class Copies:
    """Fresh copies of pristine projects, one per run, so that every run of every side does the whole work."""

    def __init__(self, scratch: Path) -> None:
        self.scratch, self.count = scratch, 0

    @contextmanager
    def fresh(self, template: Path, side: str) -> Iterator[Path]:
        """A copy of ``template`` for one run of ``side``, removed once the caller has checked it."""
        self.count += 1
        workdir = self.scratch / f"{self.count:04d}-{side}"
        shutil.copytree(template, workdir, symlinks=True)
        try:
            yield workdir
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def make_repo(root: Path, files: Mapping[str, str], *, dvc: bool) -> None:
    """A new git repository holding ``files`` (and DVC, with ``dvc``), everything in one commit."""
    root.mkdir(parents=True)
    env = base_env()
    cli(["git", "init", "-q"], root, env)
    if dvc:
        cli(["dvc", "init", "-q"], root, env)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    commit(root, "benchmark project")


def commit(root: Path, message: str) -> None:
    env = base_env()
    cli(["git", "add", "-A"], root, env)
    cli(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", message], root, env)


def run_record(root: Path) -> dict[str, Any]:
    """conveyor's record of its last run in ``root`` (``.conveyor/runs/latest.json``)."""
    path = root / ".conveyor/runs/latest.json"
    check(path.is_file(), f"{root.name}: conveyor wrote no run record ({path.relative_to(root)})")
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def check_record(record: Mapping[str, Any], stages: Sequence[str], status: str, what: str) -> None:
    """The record lists exactly ``stages``, each with ``status``, and the run succeeded."""
    got = {name: (s.get("status"), s.get("reason")) for name, s in record.get("stages", {}).items()}
    check(record.get("status") == "succeeded" and sorted(got) == sorted(stages)
          and all(st == status for st, _ in got.values()),
          f"{what}: the run record does not say every one of the {len(stages)} stages {status}: "
          f"run {record.get('status')}, stages {got}")


def check_no_leftovers(home: Path, what: str) -> None:
    """No process with ``PREFECT_HOME=home`` outlived the command by 10 s (any found are killed)."""
    left = leftovers(home)
    check(not left, f"{what} left processes running 10 s after it exited (pids {left}, killed)")


def per_stage_ms(big: Sequence[float], small: Sequence[float], extra_stages: int) -> list[float]:
    """Per repetition: (T(many stages) - T(one stage)) / extra stages, in ms."""
    return [(b - s) / extra_stages * 1000 for b, s in zip(big, small, strict=True)]


@dataclass
class SideRun:
    """A side's process: the work's seconds as it timed them, hyperfine's wall, peak RSS, its JSON report."""

    seconds: float
    wall: float
    peak_mib: float
    report: dict[str, Any]


def run_side(args: Sequence[str], side: str, env: Mapping[str, str] | None = None) -> SideRun:
    """``args`` (a ``python -c`` side or a plain script) in the repository (``env``: else :func:`repo_env`),
    timed and sampled."""
    done = timed_cli(args, REPO, repo_env() if env is None else env, memory=True)
    report = side_report(done.stdout, side)
    return SideRun(float(report["seconds"]), done.seconds, done.peak_mib, report)
