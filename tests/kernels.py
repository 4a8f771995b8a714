"""Another CPU on this one: the kernel paths an AVX2-only or a baseline x86-64 machine would take.

Each numeric library picks its kernels by the CPU it finds; each can also be told to take a
lesser path than this machine offers: torch's ATen (``ATEN_CPU_CAPABILITY``), MKL
(``MKL_ENABLE_INSTRUCTIONS``), OpenBLAS (``OPENBLAS_CORETYPE``), NumPy's run-time dispatch
(``NPY_DISABLE_CPU_FEATURES``), glibc's math functions (``GLIBC_TUNABLES``), and the thread
count of another number of cores. Runs under these and under this machine's own path stand
for runs on three machines.
"""

from __future__ import annotations

from conveyor.run.determinism import numpy_dispatched

_NUMPY = numpy_dispatched()
KERNEL_PATHS: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OPENBLAS_CORETYPE": "Haswell",
        "NPY_DISABLE_CPU_FEATURES": " ".join(f for f in _NUMPY if "512" in f or f == "X86_V4"),
    },
    "baseline": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "OPENBLAS_CORETYPE": "Nehalem",
        "NPY_DISABLE_CPU_FEATURES": " ".join(_NUMPY),
        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA",
        "OMP_NUM_THREADS": "1",  # a machine with one core
    },
}
