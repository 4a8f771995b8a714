"""Portable determinism: the settings under which a stage's CPU numerics give the same bytes on any x86-64 machine.

A seed makes a run repeatable on one machine; it does not make it repeatable on a
teammate's. The numeric libraries pick their kernels by the CPU they find (AVX-512, AVX2
or SSE), and the kernels sum in different orders: the reference MLP gave nine different
``models/mlp.pt`` hashes on one Intel Xeon under the combinations of torch's and MKL's
kernel paths, and the stacked model three under OpenBLAS's. What decides the bytes, and
what pins it (each measured on that reference pipeline):

- torch's own kernels (ATen): ``ATEN_CPU_CAPABILITY=default``, the build's baseline code
  instead of its AVX2/AVX-512 copies; read at torch's first operation in a process;
- MKL, torch's BLAS on x86: ``MKL_CBWR=COMPATIBLE``, Intel's conditional numerical
  reproducibility (one code path on every x86 CPU, Intel or AMD), with one thread;
- OpenBLAS, NumPy's and SciPy's BLAS (scikit-learn's solvers): ``OPENBLAS_CORETYPE``, the
  kernel set every x86-64 CPU runs, with one thread;
- NumPy's own SIMD loops (exp, log, ...): every feature the build dispatches at run time
  disabled, so the baseline it was compiled for runs;
- the number of threads: torch splits work by its thread count (1 and 2 threads gave two
  hashes), so every OpenMP/MKL/OpenBLAS pool has one thread;
- oneDNN (torch's ``mkldnn``): its baseline ISA; glibc's math functions: their FMA/AVX2
  variants off; Python's hash seed fixed (set iteration order).

All of them are read when a library loads, so they are an environment: a ``cmd`` stage
gets it, and a task runs in a process of its own started with it
(:mod:`conveyor.run.isolated`). What it does not cover: other architectures (ARM is its
own world), other versions of the libraries (the environment is part of the result),
GPUs (CUDA kernels differ by GPU model and CUDA build; ``CUBLAS_WORKSPACE_CONFIG`` makes a
run repeatable on one GPU, not across GPUs), and MKL's vector math, which picks its kernel by
the CPU whatever ``MKL_CBWR`` says (and, on AMD, ``MKL_ENABLE_INSTRUCTIONS``): torch's float32
``Tensor.sqrt`` and ``pow(x, 0.5)`` on CPU go there, and the per-tensor Adam's step uses it
(an AVX-512 and an AVX2 machine trained two models under every pin here); the fused Adam
(``fused=True``) takes the CPU's exact square root instead (docs/explanation/same-bytes.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping

# kernel paths pinned for every library that reads its setting from the environment
PINS: Mapping[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OPENBLAS_CORETYPE": "Prescott",  # SSE3: the kernels every x86-64 CPU runs
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "DNNL_MAX_CPU_ISA": "SSE41",  # oneDNN's name for it before 3.0
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    # run to run on one GPU only: cuBLAS's deterministic workspace (torch.use_deterministic_algorithms)
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
# glibc picks FMA/AVX2 variants of exp, log, pow, sin ... by the CPU; these tunables turn them off
_GLIBC_HWCAPS = "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4,-AVX512F"


def pinned_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a deterministic stage's process gets over ``environ`` (what it would otherwise run with)."""
    pins = dict(PINS)
    numpy_features = numpy_dispatched()
    if numpy_features:
        pins["NPY_DISABLE_CPU_FEATURES"] = " ".join(numpy_features)
        pins["NPY_ENABLE_CPU_FEATURES"] = ""  # NumPy refuses both at once; empty is unset
    tunables = environ.get("GLIBC_TUNABLES", "")
    pins["GLIBC_TUNABLES"] = f"{tunables}:{_GLIBC_HWCAPS}" if tunables else _GLIBC_HWCAPS
    return pins


def numpy_dispatched() -> list[str]:
    """The CPU features this NumPy build dispatches to at run time (its baseline is compiled in).

    Asked of a child interpreter, once per process: importing NumPy here, from a stage's thread,
    races a task importing it in another thread (CPython then hands one of them a partially
    initialised ``_multiarray_umath``: "cannot import name '__cpu_features__'").
    """
    global _DISPATCHED
    with _DISPATCHED_LOCK:
        if _DISPATCHED is None:
            _DISPATCHED = _ask_numpy()
        return list(_DISPATCHED)


_DISPATCHED: list[str] | None = None
_DISPATCHED_LOCK = threading.Lock()
_PROBE = """
import importlib
for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):  # numpy 2, numpy 1
    try:
        print(" ".join(getattr(importlib.import_module(name), "__cpu_dispatch__", [])))
        break
    except ImportError:
        continue
"""


def _ask_numpy() -> list[str]:
    loaded = sys.modules.get("numpy._core._multiarray_umath") or sys.modules.get("numpy.core._multiarray_umath")
    features = getattr(loaded, "__cpu_dispatch__", None)  # absent while a module is half initialised
    if features is not None:
        return list(features)
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "NPY_DISABLE_CPU_FEATURES": "", "NPY_ENABLE_CPU_FEATURES": ""})
    except (OSError, subprocess.TimeoutExpired):
        return []
    return probe.stdout.split() if probe.returncode == 0 else []
