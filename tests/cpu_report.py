"""Where the suite's CPU goes: ``python -m pytest -p tests.cpu_report`` (from the repository root).

Each test's CPU seconds, those of its process and of the children it waited for
(``resource.getrusage``; a server or cluster that a fixture keeps is counted in the test that
ends it), and its wall time, summed by folder and by file at the end of the run, then the tests
that took the most. On 2 cores a suite of N CPU-seconds takes at least N / 2 seconds, whatever
the scheduling: docs/development.md says what it measured.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

_ROWS = "cpu_report_rows"


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuReport:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: list[tuple[str, float, float]] = []  # node id, CPU seconds, wall seconds

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        cpu, wall = _cpu(), time.monotonic()
        try:
            return (yield)
        finally:
            self.rows.append((item.nodeid, _cpu() - cpu, time.monotonic() - wall))

    def pytest_sessionfinish(self) -> None:
        if hasattr(self.config, "workeroutput"):  # an xdist test process: its rows go to the controller
            self.config.workeroutput[_ROWS] = self.rows

    def pytest_testnodedown(self, node: Any) -> None:
        self.rows.extend(tuple(row) for row in getattr(node, "workeroutput", {}).get(_ROWS, []))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workeroutput") or not self.rows:
            return
        write = terminalreporter.write_line
        total = sum(cpu for _, cpu, _ in self.rows)
        terminalreporter.section("CPU seconds (own + waited-for children)")
        write(f"{len(self.rows)} tests: {total:,.0f} CPU-s, {sum(w for *_, w in self.rows):,.0f} s of test wall time")
        for depth, top in ((2, 12), (3, 25)):  # tests/e2e, then tests/e2e/test_run.py
            sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
            for node, cpu, wall in self.rows:
                key = "/".join(node.split("::")[0].split("/")[:depth])
                sums[key][0] += cpu
                sums[key][1] += wall
                sums[key][2] += 1
            for key, (cpu, wall, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]:
                write(f"{cpu:8.0f} CPU-s {cpu / total:6.1%} {wall:8.0f} s {n:5.0f} tests  {key}")
        for node, cpu, wall in sorted(self.rows, key=lambda row: -row[1])[:25]:
            write(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {node}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuReport(config), "cpu_report_plugin")
