"""Fixtures shared by the flows tests: a small conveyor project in ``tmp_path``.

The project has what a real one has: ``pyproject.toml`` (the root marker), a ``tasks``
package with plain functions, ``params.yaml`` and ``configs/pipeline.yaml``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

STEPS = '''\
"""Stage bodies of the test project."""

from tasks.helpers import scale


def fetch(ctx):
    return None


def prepare(ctx):
    return scale(1)


def train(ctx):
    return None


def stack(ctx):
    return None
'''

HELPERS = '''\
def scale(x):
    return x * 2
'''

UNRELATED = '''\
def unused():
    return 0
'''

PARAMS = '''\
ingest:
  shards: 4
  url: https://example.org/data.csv
preprocess:
  test_size: 0.2
train:
  xgb:
    max_depth: 3
    eta: 0.1
  mlp:
    hidden: 16
'''

GOOD_SPEC = '''\
pipeline: demo
profiles:
  io: {kind: threads, max_workers: 4}
  cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 1GiB}
  gpu: {kind: dask-cuda, fallback: cpu}
stages:
  ingest:
    task: tasks.steps:fetch
    on: io
    params: [ingest]
    outs: [data/raw]
  prepare:
    task: tasks.steps:prepare
    on: cpu
    deps: [data/raw]
    params: [preprocess]
    outs: [data/processed]
'''


class ProjectDir:
    """A conveyor project on disk; ``spec(text)`` writes configs/pipeline.yaml."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.write("pyproject.toml", '[project]\nname = "demo"\nversion = "0"\n')
        self.write("tasks/__init__.py", "")
        self.write("tasks/steps.py", STEPS)
        self.write("tasks/helpers.py", HELPERS)
        self.write("tasks/unrelated.py", UNRELATED)
        self.write("params.yaml", PARAMS)

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    def good_spec(self) -> Path:
        """A valid spec: ingest (threads) feeds prepare (dask); a gpu profile falls back to cpu."""
        return self.spec(GOOD_SPEC)

    def spec(self, text: str, rel: str = "configs/pipeline.yaml") -> Path:
        """Write a spec (dedented) and return its absolute path."""
        return self.write(rel, textwrap.dedent(text).lstrip("\n"))


@pytest.fixture
def project(tmp_path: Path) -> ProjectDir:
    return ProjectDir(tmp_path.resolve())


@pytest.fixture
def forget_packages() -> Iterator[set[str]]:
    """Packages a test imports from its own throwaway dirs; dropped from sys.modules afterwards."""
    names: set[str] = set()
    yield names
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]
