"""``python -m benchmarks [NAME...] [--quick] [--repeats N]``: run, print the table, write the results."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType

from benchmarks import harness

# in the order `python -m benchmarks` runs them all
MODULES = ("compute.ingest_concurrency", "overhead.parallel_branches", "compute.preprocess_workers", "dvc.dvc_repro",
           "overhead.reference", "overhead.noop", "overhead.chain", "dvc.sweep", "serve.predict_batch",
           "serve.serve_latency", "compute.preprocess_pandas", "compute.xgboost_dask", "compute.torch_ddp",
           "compute.memory_cap", "compute.deterministic", "dvc.scale", "overhead.edit_run", "overhead.search",
           "dvc.unshared_disk", "compute.gpu_train", "compute.checkpoint_resume", "dvc.example_get_started")
BENCHMARKS: dict[str, ModuleType] = {m.NAME: m for m in map(importlib.import_module, (f"benchmarks.{name}"
                                                                                      for name in MODULES))}


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): "
                                                               f"{', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions (about a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default: per benchmark)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in BENCHMARKS.items():
            print(f"{name}: {module.DESCRIPTION}")
        return 0
    if unknown := [n for n in args.names if n not in BENCHMARKS]:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    config = harness.Config(quick=args.quick, repeats=args.repeats)
    machine = harness.machine()
    failed = 0
    for name in args.names or list(BENCHMARKS):
        runner: Callable[[harness.Config, Callable[[str], None]], harness.Result] = BENCHMARKS[name].run
        load_before, pressure_before = os.getloadavg(), harness.cpu_pressure()
        started = time.monotonic()
        try:
            result = runner(config, _log)
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not stop the others
            checked = isinstance(exc, harness.CheckFailed)
            _log(f"{name}: CHECK FAILED, no ratio reported: {exc}" if checked else
                 f"{name}: FAILED: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        result.seconds = time.monotonic() - started
        result.about = inspect.getdoc(BENCHMARKS[name]) or ""
        result.load = (load_before, os.getloadavg())
        result.pressure = (pressure_before, harness.cpu_pressure())
        path = harness.write_result(result, machine, quick=config.quick)
        print(f"\n{harness.table(result)}\n", flush=True)
        _log(f"{name}: {result.seconds:.0f} s; written to {path.relative_to(harness.REPO)}")
    print(f"machine:\n{machine}\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
