"""The page of ``conveyor dag --format html`` as text: what a hostile value in the records cannot do.

A reason is built from the user's params (``params changed: k a → b``) and an error from an
exception's message: either may hold markup. (The page in a browser: tests/e2e/test_dag_page.py.)
"""

from __future__ import annotations

from pathlib import Path

from conveyor.cli.dag_page import STALE, StageView, page
from conveyor.spec.project import load_project

HOSTILE = '</script><img src=x onerror="alert(1)"><!--'


def test_markup_in_a_reason_or_an_error_stays_text(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text(
        "pipeline: p\nstages:\n  a: {cmd: 'echo a > a.txt', outs: [a.txt]}\n")
    project = load_project(tmp_path / "configs/pipeline.yaml")
    view = StageView(STALE, [f"params changed: x 1 → {HOSTILE}"], [], error=HOSTILE)
    html = page(project, {"a": view}, ["a"])
    assert "<img" not in html and "<!--" not in html
    assert html.count("</script>") == 2  # the template's own two: the JSON's and the code's
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html  # in the box's hover text, escaped
