"""The reference MLP trains to the same bytes on other x86-64 CPUs, not just under other kernel
settings of this one.

Forcing torch's or MKL's kernel paths by their variables (tests/e2e/test_reference.py) cannot
reach what picks its code by the CPU alone: MKL's vector math ignores ``MKL_CBWR`` and, on AMD,
``MKL_ENABLE_INSTRUCTIONS``. So the fit runs here and under qemu-user presenting other CPUs to
the same binaries (softfloat: IEEE arithmetic, the emulated CPU's feature bits): Intel and AMD
with AVX2 and no AVX-512, and one with SSE4.2 alone. Each must end with the weights this
machine's fit ends with, in the environment a ``deterministic: true`` stage gets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conveyor.run.determinism import pinned_environ

REPO = Path(__file__).resolve().parents[2]
OTHER_CPUS = ("Haswell-v4", "EPYC-Rome", "Nehalem")  # Intel AVX2, AMD AVX2, SSE4.2 (no AVX)

FIT = """
import hashlib
import numpy as np
import torch
from conveyor.run.context import StageProgress
from conveyor.train.seed import deterministic_torch
from tasks import mlp, models

rng = np.random.default_rng(7)  # the reference's shape: 30 standardised features, a binary label
x = rng.standard_normal((480, 30)).astype(np.float32)
y = (x[:, :5].sum(axis=1) + 0.5 * rng.standard_normal(480) > 0).astype(np.float32)
train, valid = (torch.tensor(x[:400]), torch.tensor(y[:400])), (torch.tensor(x[400:]), torch.tensor(y[400:]))
params = mlp.MlpParams(hidden=[32, 16], learning_rate=0.001, weight_decay=0.0001, batch_size=32,
                       max_epochs=6, patience=20)
with deterministic_torch(20170428):
    model = models.build_mlp([30, 32, 16, 1])
    fit = mlp.fit(model, train, valid, params, StageProgress())
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in fit.state.values())).hexdigest())
"""


def _fit(cpu: str | None) -> str:
    env = {**os.environ, **pinned_environ(os.environ), "PYTHONPATH": str(REPO)}
    command = [*(["qemu-x86_64", "-cpu", cpu] if cpu else []), sys.executable, "-c", FIT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="no qemu-x86_64 (Debian: apt-get install qemu-user)")
def test_the_mlp_trains_to_the_same_bytes_on_other_cpus() -> None:
    with ThreadPoolExecutor(2) as pool:
        here, *others = pool.map(_fit, [None, *OTHER_CPUS])
    assert dict(zip(OTHER_CPUS, others, strict=True)) == dict.fromkeys(OTHER_CPUS, here)
