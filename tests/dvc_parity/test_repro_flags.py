"""``dvc repro``'s flags beyond the selection (``-p``, ``-P``, ``-k``, ``-R``, ``--glob``, ``--no-commit``,
``--allow-missing``, ``--no-run-cache``) and the definition edits, from DVC's tests/func/repro/,
test_stage_load.py and test_run_cache.py, as twin projects (conftest.py): each case's id names the
DVC test.
"""

from __future__ import annotations

import pytest
from test_repro import ADDED, CHAIN, COPY_PY, RAN, RUN1, T
from twins import Case, Twins, run_twins

pytestmark = pytest.mark.slow

M = "tests/func/repro/test_repro_allow_missing.py::"
S = "tests/func/test_stage_load.py::"
RC = "tests/func/test_run_cache.py::"

# two stages: the first writes its out and fails (a list of commands), the second reads it
KEEP_GOING = {"copy.py": COPY_PY, "bar": "bar\n", "foo": "foo\n", "dvc.yaml": """
    stages:
      copy-bar-foobar:
        cmd: [python copy.py bar foobar, exit 1]
        deps: [bar]
        outs: [foobar]
      cat: {cmd: cat foobar foo, deps: [foobar, foo]}
      other: {cmd: echo other > other.txt, outs: [other.txt]}
"""}

TWO_PIPELINES = {"copy.py": COPY_PY, "foo": "foo\n", "bar": "bar\n", "dvc.yaml": """
    stages:
      copy-FOO-file1: {cmd: python copy.py foo file1, deps: [foo, copy.py], outs: [file1]}
      copy-BAR-file2: {cmd: python copy.py bar file2, deps: [bar, copy.py], outs: [file2]}
"""}

ALL_PIPELINES = {"dvc.yaml": """
    stages:
      start: {cmd: echo start > start.txt, outs: [start.txt]}
      middle: {cmd: echo middle > middle.txt, deps: [start.txt], outs: [middle.txt]}
      final: {cmd: echo final > final.txt, deps: [middle.txt], outs: [final.txt]}
      disconnected: {cmd: echo other > disconnected.txt, outs: [disconnected.txt]}
"""}

# a chain whose first out is gone from the workspace (and, in some cases, from the cache)
MISSING = {"fixed": "fixed\n", "dvc.yaml": """
    stages:
      create-foo: {cmd: echo foo > foo, deps: [fixed], outs: [foo]}
      copy-foo: {cmd: cp foo bar, deps: [foo], outs: [bar]}
"""}
FOO_OBJECT = ".dvc/cache/files/md5/d3/b07384d113edec49eaa6238ad5ff00"  # md5 of "foo\n"

# DVC's `stages` fixture (tests/func/test_stage_load.py), foo under `dvc add`
STAGES = {"foo": "foo\n", "dvc.yaml": """
    stages:
      lorem-generate: {cmd: echo lorem > lorem, outs: [lorem]}
      copy-lorem-ipsum: {cmd: cp lorem ipsum, deps: [lorem], outs: [ipsum]}
      copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
      copy-bar-foobar: {cmd: cp bar foobar, deps: [bar], outs: [foobar]}
"""}

# a local-directory DVC remote beside the twins (the same one for both: a relative path in .dvc/config)
REMOTE = ("dvc remote add -q -d store ../../$(basename $PWD)-remote",)

PARAMS = """
    answer: 42
    floats: 42.0
    lists: [42, 42.0, "42"]
    name: Answer
    nested: {nested1: {nested2: "42", nested2-2: 41.99999}}
"""

CASES = [
    Case(T + "test_repro_keep_going", KEEP_GOING, ("-k",), setup=("dvc add -q foo bar",),
         succeeds=False, dropped=("foobar",), ignored=("/other.txt",)),
    Case(T + "test_repro_pipeline", CHAIN, ("-p", "-f", "copy-file-file2"), setup=RAN),
    Case(T + "test_repro_pipeline (a disconnected stage is not run)",
         {**CHAIN, "dvc.yaml": CHAIN["dvc.yaml"] + "      other: {cmd: echo other > other.txt, outs: [other.txt]}\n"},
         ("-p", "-f", "run1"), setup=ADDED),
    Case(T + "test_repro_pipeline_cli", RUN1, ("--pipeline", "-f", "run1"), setup=RAN),
    Case(T + "test_repro_pipelines", TWO_PIPELINES, ("-f", "-P"), setup=("dvc add -q foo bar", "dvc repro -q")),
    Case(T + "test_repro_all_pipelines", ALL_PIPELINES, ("--all-pipelines",)),
    Case(T + "test_repro_no_commit", RUN1, ("run1", "--no-commit"), setup=(*RAN, "rm -rf .dvc/cache")),
    Case(M + "test_repro_allow_missing", MISSING, ("--allow-missing",),
         setup=("dvc repro -q", "rm foo", f"rm {FOO_OBJECT}", "rm -rf .dvc/cache/runs")),
    Case(M + "test_repro_allow_missing_cached", MISSING, ("--allow-missing",), setup=("dvc repro -q", "rm foo")),
    Case(M + "test_repro_allow_missing (a changed dep still runs)", MISSING, ("--allow-missing",),
         setup=("dvc repro -q", "rm foo", "echo more > fixed")),
    Case(T + "test_repro_when_new_deps_is_added_in_dvcfile", {"copy.py": COPY_PY, "foo": "foo\n", "bar": "bar\n",
                                                            "dvc.yaml": """
            stages:
              copy-file: {cmd: python copy.py foo foobar, deps: [foo], outs: [foobar]}
         """}, ("dvc.yaml:copy-file",), setup=("dvc repro -q",),
         then=("sed -i 's/deps: \\[foo\\]/deps: [foo, copy.py]/' dvc.yaml",)),
    Case(T + "test_repro_when_new_deps_is_moved", {"copy.py": COPY_PY, "foo": "foo\n", "dvc.yaml": """
            stages:
              copy-file: {cmd: python copy.py foo foobar, deps: [foo], outs: [foobar]}
         """}, (":copy-file",), setup=("dvc repro -q",),
         then=("printf 'import shutil\\nshutil.copyfile(\"bar\", \"foobar\")\\n' > copy.py", "mv foo bar",
               "sed -i 's/deps: \\[foo\\]/deps: [bar]/' dvc.yaml")),
    Case(T + "test_repro_multiple_params", {"params.yaml": PARAMS, "params2.yaml": PARAMS, "foo": "foo\n",
                                            "dvc.yaml": """
            stages:
              read_params:
                cmd: cat params2.yaml params.yaml > bar
                deps: [foo]
                outs: [bar]
                params:
                - params2.yaml: [lists, floats, name]
                - answer
                - floats
                - nested.nested1
         """}, ("read_params",), setup=("dvc repro -q",), then=("sed -i 's/^answer: 42/answer: 43/' params.yaml",)),
    Case(S + "test_collect_glob", STAGES, ("--glob", "'copy-lorem*'"), setup=("dvc add -q foo",)),
    Case(S + "test_collect_glob (copy*)", STAGES, ("--glob", "'copy*'"), setup=("dvc add -q foo",)),
    Case(S + "test_collect_generated", {"dvc.yaml": """
            vars: [{vars: [1, 2, 3, 4, 5]}]
            stages:
              build: {foreach: "${vars}", do: {cmd: "echo ${item} > out-${item}", outs: ["out-${item}"]}}
         """}, ("--glob", "'build@[24]'")),
    Case(S + "test_collect_dir_recursive", {"dir/foo": "foo\nbar\n", "dir/dvc.yaml": """
            stages:
              head-foo: {cmd: head -n 1 foo > foo-1, deps: [foo], outs: [foo-1]}
              head-foo1: {cmd: head -n 1 foo-1 > foo-2, deps: [foo-1], outs: [foo-2]}
         """, "dvc.yaml": """
            stages:
              other: {cmd: echo other > other.txt, outs: [other.txt]}
         """}, ("-R", "dir"), setup=("dvc add -q dir/foo",)),
    Case(T + "test_repro_pulls_missing_data_source", {"foo": "foo\n", "later.yaml": """
            stages:
              copy-foo: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("--pull",), setup=(*REMOTE, "dvc add -q foo", "dvc push -q", "mv later.yaml dvc.yaml", "rm foo",
                                   f"rm {FOO_OBJECT}")),
    Case(M + "test_repro_allow_missing_and_pull", MISSING, ("--pull", "--allow-missing"),
         setup=(*REMOTE, "dvc repro -q create-foo", "dvc push -q", "rm foo", f"rm {FOO_OBJECT}",
                "rm -rf .dvc/cache/runs")),
    Case(M + "test_repro_allow_missing_upstream_stage_modified", {"params.yaml": "param: 1\n", "dvc.yaml": """
            stages:
              create-foo: {cmd: "echo ${param} > foo", params: [param], outs: [foo]}
              copy-foo: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("--pull", "--allow-missing"),
         setup=(*REMOTE, "dvc repro -q", "dvc push -q", "echo 'param: 2' > params.yaml", "dvc repro -q create-foo",
                "dvc push -q", "rm foo", "rm .dvc/cache/files/md5/26/ab0db90d72e28ad0ba1e22ee510510")),
    Case(RC + "test_restore_pull", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("--pull", "copy-foo-bar"),
         setup=(*REMOTE, "dvc repro -q", "dvc push -q --run-cache", "rm bar dvc.lock", f"rm {FOO_OBJECT}",
                "rm -rf .dvc/cache/runs")),
    Case(RC + "test_restore, with --no-run-cache: the command runs", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("--no-run-cache", "copy-foo-bar"), setup=("dvc repro -q",), then=("rm bar dvc.lock",)),
    Case(RC + "test_restore, with --no-run-cache and dvc.lock kept: bar checked out from its entry",
         {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("--no-run-cache", "copy-foo-bar"), setup=("dvc repro -q",), then=("rm bar",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id.rpartition("::")[2] for c in CASES])
def test_conveyor_run_does_what_dvc_repro_does(twins: Twins, case: Case) -> None:
    run_twins(twins, case)
