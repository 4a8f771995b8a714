"""What a run records of the packages a stage's code imports: the distributions that provide them,
found from their metadata as it is installed (names unlike the import's, a file list only)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from conveyor.run import environment


def test_a_stage_s_imports_are_named_by_the_distributions_that_provide_them(tmp_path: Path) -> None:
    code = tmp_path / "stage.py"
    code.write_text("import sklearn, yaml, numpy as np\nfrom dateutil import parser\nimport os, json, helpers\n")
    (tmp_path / "helpers.py").write_text("")
    found = environment.packages([code])
    assert found == {name: importlib.metadata.version(name)
                     for name in ("scikit-learn", "PyYAML", "numpy", "python-dateutil")}


def test_a_distribution_without_top_level_txt_is_read_from_its_file_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    for path, text in {"odd_name/__init__.py": "", "single.py": "",
                       "other_dist-2.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: other-dist\nVersion: 2.0\n",
                       "other_dist-2.0.dist-info/RECORD": "odd_name/__init__.py,,\nsingle.py,,\n"
                                                          "other_dist-2.0.dist-info/RECORD,,\n"}.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    environment._distributions.cache_clear()
    environment.provided.cache_clear()
    code = tmp_path / "stage.py"
    code.write_text("import odd_name\nimport single\n")
    try:
        assert environment.packages([code]) == {"other-dist": "2.0"}
        assert environment.provided(site) == {"odd_name": [site / "other_dist-2.0.dist-info"],
                                              "single": [site / "other_dist-2.0.dist-info"]}
    finally:  # what this test's site made these caches hold, gone with it
        for cached in (environment._distributions, environment.provided, environment._version):
            cached.cache_clear()
