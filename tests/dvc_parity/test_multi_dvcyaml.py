"""A pipeline across several dvc.yaml files (issue 32 item 3): ``dvc repro`` and ``conveyor run``
on twin projects (conftest.py), where the root dvc.yaml reads outs of stages in sub/dvc.yaml.

What ``dvc repro`` does there (dvc/repo/reproduce.py, checked with the dvc CLI): with no target
it takes the stages of the dvc.yaml in the working directory, not every pipeline of the
repository (that is ``--all-pipelines``), and runs them with everything upstream of them in the
repository's graph, stages of other dvc.yaml files included, each in its own wdir, recorded in
the dvc.lock beside its own dvc.yaml and named as ``sub/dvc.yaml:make``. A frozen stage cuts
its upstream (``get_active_graph``).

DVC's functional tests pin these behaviours with one dvc.yaml; each case here carries the
scenario of the DVC test its id names across two (or three) dvc.yaml files.
"""

from __future__ import annotations

import pytest
import yaml
from twins import Case, Twins, run_twins

pytestmark = pytest.mark.slow

T = "tests/func/repro/test_repro.py::"
COPY_PY = "import shutil, sys\nshutil.copyfile(sys.argv[1], sys.argv[2])\n"

# use (./dvc.yaml) reads sub/made, which make (sub/dvc.yaml, run in sub/) writes from foo;
# lonely (sub/dvc.yaml) and unrelated (other/dvc.yaml) are upstream of nothing here
TWO = {"copy.py": COPY_PY, "foo": "foo\n", "bar": "bar\n",
       "sub/dvc.yaml": """
            stages:
              make:
                cmd: python ../copy.py ../foo made
                deps: [../foo, ../copy.py]
                outs: [made]
              lonely:
                cmd: echo lonely > lonely
                outs: [lonely]
       """,
       "other/dvc.yaml": """
            stages:
              unrelated: {cmd: echo x > x, outs: [x]}
       """,
       "dvc.yaml": """
            stages:
              use:
                cmd: python copy.py sub/made used
                deps: [sub/made, copy.py]
                outs: [used]
       """}
RAN = ("dvc repro -q", "git add -A", "git commit -qm ran")

# a chain over three files: a/dvc.yaml -> b/dvc.yaml -> dvc.yaml, with wdir and params of their own
CHAIN = {"copy.py": COPY_PY, "foo": "foo\n",
         "a/params.yaml": "n: 1\n",
         "a/dvc.yaml": """
            stages:
              first:
                cmd: python ../copy.py ../foo one && echo ${n} >> one
                deps: [../foo, ../copy.py]
                params: [n]
                outs: [one]
         """,
         "b/dvc.yaml": """
            stages:
              second:
                wdir: ..
                cmd: python copy.py a/one b/two
                deps: [a/one, copy.py]
                outs: [b/two]
         """,
         "dvc.yaml": """
            stages:
              third:
                cmd: python copy.py b/two three
                deps: [b/two, copy.py]
                outs: [three]
         """}

# a foreach in sub/dvc.yaml of which the root reads one item
FOREACH = {"sub/dvc.yaml": """
              stages:
                gen:
                  foreach: [a, b]
                  do:
                    cmd: echo ${item} > ${item}.txt
                    outs:
                      - ${item}.txt
           """,
           "dvc.yaml": """
              stages:
                use: {cmd: cat sub/a.txt > used, deps: [sub/a.txt], outs: [used]}
           """}

CASES = [
    Case("no target: this dvc.yaml and its upstream in sub/dvc.yaml, no other pipeline (" + T
         + "test_repro_pipeline)", TWO),
    Case(T + "test_repro_up_to_date, across two dvc.yaml", TWO, setup=RAN),
    Case(T + "test_repro_changed_data, read by sub/dvc.yaml", TWO, setup=RAN, then=("cp bar foo",)),
    Case(T + "test_repro_changed_data, dvc add-ed and read by sub/dvc.yaml", TWO,
         setup=("dvc add -q foo", *RAN), then=("cp bar foo",)),
    Case(T + "test_repro_when_cmd_changes, in sub/dvc.yaml", TWO, setup=RAN,
         then=("sed -i 's/copy.py ..\\/foo made/copy.py  ..\\/foo  made/' sub/dvc.yaml",)),
    Case(T + "test_repro_when_lockfile_gets_deleted, sub/dvc.lock", TWO, setup=RAN, then=("rm sub/dvc.lock",)),
    Case("a stage of sub/dvc.yaml as the target (" + T + "test_repro_single_item_with_multiple_targets)",
         TWO, ("sub/dvc.yaml:make",)),
    Case(T + "test_downstream, from a stage of sub/dvc.yaml", TWO, ("--downstream", "sub/dvc.yaml:make"),
         setup=RAN, then=("cp bar foo",)),
    Case("-s: the target alone, its upstream in sub/dvc.yaml not run (" + T
         + "test_repro_single_item_with_multiple_targets)", TWO, ("-s", "use"), setup=RAN, then=("cp bar foo",)),
    Case(T + "test_repro_frozen: a frozen stage cuts its upstream in sub/dvc.yaml", TWO, setup=RAN,
         then=("dvc freeze -q use", "cp bar foo")),
    Case(T + "test_repro_changed_deep_data, over three dvc.yaml with wdir and params of their own", CHAIN,
         setup=RAN, then=("echo new > foo",)),
    Case(T + "test_repro_multiple_params, in a/params.yaml beside a/dvc.yaml", CHAIN, setup=RAN,
         then=("echo 'n: 2' > a/params.yaml",)),
    Case("one foreach item of sub/dvc.yaml upstream (" + T + "test_repro_pipeline)", FOREACH),
    Case(T + "test_repro_all_pipelines, every dvc.yaml: lonely and unrelated too", TWO, ("-P",)),
    Case(T + "test_downstream, into a third dvc.yaml that reads the target's out", {**TWO, "third/dvc.yaml": """
            stages:
              after: {cmd: cat ../used > after, deps: [../used], outs: [after]}
         """}, ("--downstream", "-f", "use"), setup=RAN),
    Case(T + "test_repro_pipeline, from a stage of sub/dvc.yaml: its pipeline, not lonely", TWO,
         ("-p", "-f", "sub/dvc.yaml:make"), setup=RAN),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id.removeprefix(T) for c in CASES])
def test_conveyor_run_does_what_dvc_repro_does_across_dvc_yaml_files(twins: Twins, case: Case) -> None:
    run_twins(twins, case)


def test_a_stage_of_another_dvc_yaml_upstream_of_nothing_here_says_how_to_run_it(twins: Twins) -> None:
    """``dvc repro sub/dvc.yaml:lonely`` runs it; conveyor runs one dvc.yaml (and its upstream), so it
    says, in one line, how to run that stage from its own file, and that command does what DVC does."""
    theirs, ours = twins.make(Case("lonely", TWO))
    refused = twins.sh(ours, "conveyor run sub/dvc.yaml:lonely", check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = (refused.stdout + refused.stderr).strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert said.endswith("run that one with `conveyor run -c sub/dvc.yaml lonely`"), said
    assert not (ours / "sub/lonely").exists()
    twins.sh(theirs, "dvc repro sub/dvc.yaml:lonely")
    twins.sh(ours, "conveyor run -c sub/dvc.yaml lonely")
    assert (ours / "sub/lonely").read_text() == (theirs / "sub/lonely").read_text() == "lonely\n"
    assert yaml.safe_load((ours / "sub/dvc.lock").read_text()) == yaml.safe_load((theirs / "sub/dvc.lock").read_text())
