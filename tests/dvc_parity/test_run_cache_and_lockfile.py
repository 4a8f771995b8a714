"""``dvc repro`` and ``conveyor run`` on twin projects: DVC's run cache and lock file, case by case
from iterative/dvc tests/func/test_run_cache.py and tests/func/test_lockfile.py (each id names the
test it mirrors). The cache compared includes the run cache's entries (conftest.py)."""

from __future__ import annotations

import pytest
from twins import Case, Twins, run_twins

pytestmark = pytest.mark.slow

RC = "tests/func/test_run_cache.py::"
LF = "tests/func/test_lockfile.py::"

COPY = {"foo": "foo\n", "dvc.yaml": """
    stages:
      copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
"""}
HEAD = {"foo": "bar\nfoobar\n", "bar": "foo\nfoobar\n", "foobar": "foobar\nbar\n", "dvc.yaml": """
    stages:
      copy-first-line:
        cmd: for f in foo bar foobar; do head -n 1 $f > $f-1; done
        deps: [foo, bar, foobar]
        outs: [foo-1, bar-1, foobar-1]
"""}

CASES = [
    Case(RC + "test_restore", COPY, ("copy-foo-bar",), setup=("dvc repro -q",), then=("rm bar dvc.lock",)),
    Case(RC + "test_memory_for_multiple_runs_of_same_stage (the newer run)", COPY, ("copy-foo-bar",),
         setup=("dvc repro -q", "echo foobar > foo", "dvc repro -q"), then=("rm bar dvc.lock",)),
    Case(RC + "test_memory_for_multiple_runs_of_same_stage (the older run)", COPY, ("copy-foo-bar",),
         setup=("dvc repro -q", "echo foobar > foo", "dvc repro -q"), then=("rm dvc.lock", "echo foo > foo")),
    Case(RC + "test_outs_no_cache_deactivate_run_cache", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar:
                cmd: cp foo bar && cp foo goo
                deps: [foo]
                outs: [goo, {bar: {cache: false}}]
         """}),
    Case(RC + "test_save", COPY),
    Case(LF + "test_deps_outs_are_sorted_by_path", HEAD),
    Case(LF + "test_order_is_preserved_when_pipeline_order_changes", HEAD, ("copy-first-line",),
         setup=("dvc repro -q",), then=("sed -i 's/deps: \\[foo, bar, foobar\\]/deps: [foobar, bar, foo]/' dvc.yaml",
                                        "rm dvc.lock")),
    Case(LF + "test_cmd_changes_other_orders_are_preserved", HEAD, ("copy-first-line",),
         setup=("dvc repro -q",), then=("sed -i 's/head -n 1/head -n 2/' dvc.yaml",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id.split("/")[-1] for c in CASES])
def test_conveyor_run_does_what_dvc_repro_does(twins: Twins, case: Case) -> None:
    run_twins(twins, case)
