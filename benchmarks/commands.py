"""Whole commands timed by hyperfine (``--export-json``, no shell: ``-N``), with their process tree's memory
from psutil. hyperfine: https://github.com/sharkdp/hyperfine (``apt-get install hyperfine``, ``brew install
hyperfine``). The sides alternate over repetitions (:func:`alternating`): a shared machine's load drifts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import check
from benchmarks.processes import MIB, Sampler, stop_group

TIMEOUT_S = 600  # any one command
INSTALL = "hyperfine is not installed: apt-get install hyperfine (or brew/cargo install hyperfine)"


@dataclass(frozen=True)
class Timed:
    """One run: hyperfine's seconds, its stdout, its tree's peak RSS (MiB), whether its group outlived it by 10 s."""

    seconds: float
    stdout: str
    peak_mib: float = 0.0
    left: bool = False


def hyperfine() -> str:
    found = shutil.which("hyperfine")
    check(found is not None, INSTALL)
    return str(found)


def timed(argv: Sequence[str], cwd: Path, env: Mapping[str, str], *, memory: bool = False,
          timeout: float = TIMEOUT_S, strict: bool = True) -> Timed:
    """One run of ``argv`` under hyperfine: its time, stdout, (``memory``) its tree's peak RSS sampled every 100 ms;
    checked to exit 0 and (``strict``) to leave nothing running 10 s after."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-hyperfine-") as tmp:
        export, output = Path(tmp) / "hyperfine.json", Path(tmp) / "stdout"
        args = [hyperfine(), "-N", "--style", "none", "--runs", "1", "--ignore-failure", "--output", str(output),
                "--export-json", str(export), shlex.join(argv)]
        proc, peak, left = _run(args, cwd, env, timeout=timeout, sample=memory)
        stdout = output.read_text(errors="replace") if output.is_file() else ""
        check(proc.returncode == 0 and export.is_file(), f"hyperfine {shlex.join(argv)} in {cwd.name} exited "
                                                         f"{proc.returncode}: {proc.stderr[-2000:]}")
        (result,) = json.loads(export.read_text())["results"]
    code = result["exit_codes"][0]
    check(code == 0, f"`{shlex.join(argv)}` in {cwd.name} exited {code}:\n{stdout[-3000:]}")
    check(not (strict and left), f"`{shlex.join(argv)}` in {cwd.name}: processes it started were still running "
                                 "10 s after it exited (killed)")
    return Timed(float(result["times"][0]), stdout, peak / MIB, left)


def _run(args: list[str], cwd: Path, env: Mapping[str, str], *, timeout: float = TIMEOUT_S,
         sample: bool = False) -> tuple[subprocess.CompletedProcess[str], int, bool]:
    """hyperfine in a process group of its own: its output, its tree's peak RSS, whether the group outlived it."""
    proc = subprocess.Popen(args, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    sampler = Sampler(proc.pid, root=False)
    with sampler if sample else contextlib.nullcontext():
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    left = stop_group(proc.pid, grace_s=10)
    return subprocess.CompletedProcess(args, proc.returncode, out, err), sampler.peak, left


def alternating(baseline: Sequence[str], candidate: Sequence[str], cwd: Path, env: Mapping[str, str], repeats: int,
                *, warmup: int = 1) -> tuple[list[float], list[float]]:
    """``repeats`` hyperfine calls of one run per side, B C then C B...; hyperfine's warm-up on the first only.
    Every run must exit 0."""
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-hyperfine-") as tmp:
        export = Path(tmp) / "hyperfine.json"
        for i in range(repeats):
            args = [hyperfine(), "-N", "--style", "none", "--runs", "1", "--warmup", str(warmup if i == 0 else 0),
                    "--export-json", str(export)]
            order = [("baseline", baseline), ("candidate", candidate)][::-1 if i % 2 else 1]
            for name, argv in order:
                args += ["--command-name", name, shlex.join(argv)]
            proc, _, left = _run(args, cwd, env)
            check(not left, f"hyperfine in {cwd.name}: processes of its group outlived it by 10 s (killed)")
            check(proc.returncode == 0, f"hyperfine in {cwd.name} exited {proc.returncode}: {proc.stderr[-2000:]}")
            for (name, _argv), result in zip(order, json.loads(export.read_text())["results"], strict=True):
                times[name] += [float(t) for t in result["times"]]
    return times["baseline"], times["candidate"]
