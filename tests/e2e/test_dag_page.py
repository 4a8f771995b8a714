"""``conveyor dag --format html``: the page a user opens, checked as data and rendered in a real
headless Chromium (tests/browser.py); without a chromium binary the rendering is skipped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, browse, needs_chromium, rendered
from projects import Project


def stages_of(html: str) -> dict[str, Any]:
    """The stages' details as the page carries them (its JSON)."""
    found = re.search(r'<script type="application/json" id="stages">(.*?)</script>', html, re.S)
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1))
    return data


@needs_chromium
def test_the_browser_check_catches_a_page_that_fails(tmp_path: Path) -> None:
    """The check itself: a page whose script throws is caught (else a clean run proves nothing)."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><html><body><p>x</p><script>missing();</script></body></html>")
    _, console = browse(bad, tmp_path / "chromium", "--dump-dom")
    assert any("Uncaught ReferenceError: missing is not defined" in line for line in console), console


@pytest.mark.slow
def test_after_a_params_change_the_page_marks_the_stale_stages(reference_project: Project, tmp_path: Path) -> None:
    project = reference_project
    ran = project.conveyor("run", "preprocess")  # ingest and preprocess: no training
    assert ran.returncode == 0, ran.stderr[-3000:]
    params = project.root / "params.yaml"
    params.write_text(params.read_text().replace("valid_fraction: 0.15", "valid_fraction: 0.2"))

    made = project.conveyor("dag", "--format", "html", "-o", "dag.html")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"wrote dag.html: open {(project.root / 'dag.html').as_uri()}"
    html = (project.root / "dag.html").read_text()
    assert re.findall(r"\b(?:src|href)\s*=|<link|@import|url\((?!#)", html) == []  # nothing to fetch
    stages = stages_of(html)
    assert {name: s["state"] for name, s in stages.items()} == {
        "ingest": "up to date", "preprocess": "stale", "train_xgb": "never run", "train_mlp": "never run",
        "stack": "never run", "evaluate": "never run"}
    assert stages["preprocess"]["reasons"] == ["params changed: preprocess.valid_fraction 0.15 → 0.2"]
    assert stages["preprocess"]["profile"].startswith("cpu") and stages["preprocess"]["duration"].endswith("s")
    assert stages["ingest"]["critical"] and stages["preprocess"]["critical"]
    assert re.search(r'class="edge critical" data-up="ingest" data-down="preprocess"', html)
    assert 'data-stage="preprocess" data-state="stale"' in html

    if CHROMIUM is None:
        pytest.skip("no chromium binary to render the page (Debian: apt-get install chromium)")
    dom = rendered(project.root / "dag.html", tmp_path, fragment="#preprocess")  # opens its details
    details = re.search(r'<aside id="details".*?</aside>', dom, re.S)
    assert details is not None and "params changed: preprocess.valid_fraction 0.15 → 0.2" in details.group(0)
    assert not project.left_running()


@pytest.mark.slow
def test_a_failed_run_names_the_page_and_the_page_names_the_failure(
        make_project: Callable[[], Project], tmp_path: Path) -> None:
    project = make_project()
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", """
        def write(ctx):
            ctx.out("out/a.txt").write_text("a")

        def fail(ctx):
            raise RuntimeError("b broke on purpose")
        """)
    project.write("configs/pipeline.yaml", """
        pipeline: broken
        stages:
          a: {task: tasks.steps:write, outs: [out/a.txt]}
          b: {task: tasks.steps:fail, deps: [out/a.txt], outs: [out/b.txt]}
          c: {task: tasks.steps:write, deps: [out/b.txt], outs: [out/c.txt]}
        """)
    ran = project.conveyor("run")
    assert ran.returncode == 1
    assert "dag:     conveyor dag --format html  (a page: b failed, the stages it holds up, and why)" in ran.stdout
    assert ran.stdout.strip().splitlines()[-1] == "resume with: conveyor run b --downstream"

    made = project.conveyor("dag", "--format", "html")
    assert made.returncode == 0, made.stderr
    page = project.root / ".conveyor/dag.html"
    stages = stages_of(page.read_text())
    assert {name: s["state"] for name, s in stages.items()} == {
        "a": "up to date", "b": "failed in the last run", "c": "never run"}
    assert "b broke on purpose" in stages["b"]["error"]
    if CHROMIUM is None:
        pytest.skip("no chromium binary to render the page (Debian: apt-get install chromium)")
    dom = rendered(page, tmp_path)  # no stage named: the failed one's details are open
    assert re.search(r'<aside id="details"[^>]*style="display: block;"', dom)
    assert "b broke on purpose" in dom


@needs_chromium
def test_two_hundred_stages_render_in_chromium(tmp_path: Path) -> None:
    """A sweep's shape: prepare fans out to 198 trainings (some chained), which evaluate reads."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'wide'\n")
    lines = ["pipeline: wide", "stages:", "  prepare: {cmd: 'echo p > p.txt', outs: [p.txt]}"]
    for i in range(198):
        after = f", needs: [train_{i - 7:03d}]" if i >= 7 and i % 3 == 0 else ""
        lines.append(f"  train_{i:03d}: {{cmd: 'echo {i} > m{i}.txt', deps: [p.txt], outs: [m{i}.txt]{after}}}")
    lines.append("  evaluate: {cmd: 'cat m*.txt > all.txt', deps: [" +
                 ", ".join(f"m{i}.txt" for i in range(198)) + "], outs: [all.txt]}")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    made = subprocess.run(["conveyor", "dag", "--format", "html", "-o", "-"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "100"})
    print(f"conveyor dag --format html, 200 stages: {time.monotonic() - t0:.2f}s")
    assert made.returncode == 0, made.stderr
    page = tmp_path / "wide.html"
    page.write_text(made.stdout)
    assert len(stages_of(made.stdout)) == 200
    assert made.stdout.count('class="stage ') == 200
    rendered(page, tmp_path)
