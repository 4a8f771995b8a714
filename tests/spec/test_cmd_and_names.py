"""cmd stages, named paths, persist and ``${...}`` in specs (SPEC.md sections 2.1 and 2.2).

Each case writes a spec into a real project in ``tmp_path`` and pins what the user reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conveyor.errors import SpecError
from conveyor.spec.interpolate import InterpolationError, interpolate
from conveyor.spec.project import load_project

if TYPE_CHECKING:
    from conftest import ProjectDir


def messages(path: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_project(path)
    return [str(issue).split(" ", 1)[1] for issue in info.value.issues]  # without the file:line


def line_of(path: Path) -> list[int | None]:
    with pytest.raises(SpecError) as info:
        load_project(path)
    return [issue.line for issue in info.value.issues]


# --- ${...} ---------------------------------------------------------------------------------

PARAMS = {"train": {"lr": 0.1, "layers": [8, 4], "fast": True, "name": "xgb"}, "seed": 42}


@pytest.mark.parametrize(("text", "expected"), [
    ("python train.py --lr ${train.lr} --seed ${seed}", "python train.py --lr 0.1 --seed 42"),
    ("models/${train.name}-${ seed }.json", "models/xgb-42.json"),
    ("--fast ${train.fast}", "--fast true"),
    (r"echo \${HOME} and ${seed}", "echo ${HOME} and 42"),
    ("no placeholder", "no placeholder"),
])
def test_interpolation_reads_dotted_keys(text: str, expected: str) -> None:
    assert interpolate(text, PARAMS) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("${train.rl}", r"unknown param key '\$\{train.rl\}' \(did you mean 'train.lr'\?\)"),
    ("${train.layers}", r"'\$\{train.layers\}' is a list: interpolate a single value"),
    ("${train}", r"'\$\{train\}' is a mapping: interpolate a single value"),
])
def test_interpolation_of_what_is_not_a_value_says_so(text: str, message: str) -> None:
    with pytest.raises(InterpolationError, match=message):
        interpolate(text, PARAMS)


def test_a_cmd_and_its_paths_are_interpolated_and_the_spec_as_written_is_kept(project: ProjectDir) -> None:
    project.write("params.yaml", "train: {lr: 0.5, name: xgb}\n")
    project.write("scripts/train.py", "")
    spec = project.spec("""
        pipeline: demo
        stages:
          train:
            cmd: python scripts/train.py --lr ${train.lr} models/${train.name}.json
            deps: [scripts/train.py]
            outs:
              - models/${train.name}.json
    """)
    loaded = load_project(spec)
    stage = loaded.pipeline.stages["train"]
    assert (stage.cmd, stage.outs) == ("python scripts/train.py --lr 0.5 models/xgb.json", ("models/xgb.json",))
    written = loaded.as_written.stages["train"]
    assert (written.cmd, written.outs) == ("python scripts/train.py --lr ${train.lr} models/${train.name}.json",
                                           ("models/${train.name}.json",))


def test_an_unknown_key_in_a_cmd_is_an_error_at_its_line(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          train:
            cmd: python train.py --depth ${train.xgb.max_dpth}
            outs: [models/x.json]
    """)
    assert messages(spec) == ["stages.train.cmd: unknown param key '${train.xgb.max_dpth}' "
                              "(did you mean 'train.xgb.max_depth'?)"]
    assert line_of(spec) == [4]


# --- task or cmd ------------------------------------------------------------------------------


def test_a_stage_needs_exactly_one_of_task_and_cmd(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          both: {task: "tasks.steps:fetch", cmd: "echo hi", outs: [data/a]}
          neither: {outs: [data/b]}
    """)
    wanted = ("a stage runs a task (module:function) or a cmd (a shell command): give exactly one")
    assert messages(spec) == [f"stages.both: {wanted}", f"stages.neither: {wanted}"]


def test_wdir_is_for_commands_and_must_be_a_directory_of_the_project(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", wdir: src, outs: [data/a]}
          b: {cmd: "make", wdir: nowhere, outs: [data/b]}
          c: {cmd: "make", wdir: ../elsewhere, outs: [data/c]}
          d: {cmd: "", outs: [data/d]}
    """)
    assert messages(spec) == [
        "stages.a: 'wdir' is where a cmd runs: a task stage has none",
        "stages.b.wdir: 'nowhere' is not a directory of the project (a cmd runs in it)",
        "stages.c.wdir: '../elsewhere' leaves the project: paths must stay inside the project root",
        "stages.d.cmd: an empty command: write the shell command to run",
    ]


def test_a_task_module_that_does_not_parse_is_a_spec_error(project: ProjectDir) -> None:
    project.write("tasks/broken.py", "def fetch(ctx):\n  return (\n")
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.broken:fetch", outs: [data/raw]}
    """)
    (message,) = messages(spec)
    assert message.startswith(f"stages.ingest.task: task 'tasks.broken:fetch': {project.root / 'tasks/broken.py'}:")
    assert message.endswith("; fix the module")


# --- named paths and persist ------------------------------------------------------------------


def test_named_paths_and_persist_outs(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw, {data/cache: {persist: true}}]}
          stack:
            task: tasks.steps:stack
            deps: {data: data/raw, cache: ./data/cache/}
            outs: {model: {path: models/stack.json, persist: true}}
            metrics: {scores: metrics/stack.json}
    """)
    loaded = load_project(spec)
    ingest, stack = loaded.pipeline.stages["ingest"], loaded.pipeline.stages["stack"]
    assert ingest.outs == ("data/raw", "data/cache") and ingest.persist == {"data/cache"}
    assert stack.deps == ("data/raw", "data/cache")  # normalised, as list items are
    assert stack.names == {"data": "data/raw", "cache": "data/cache", "model": "models/stack.json",
                           "scores": "metrics/stack.json"}
    assert stack.persist == {"models/stack.json"}
    assert loaded.graph["stack"] == frozenset({"ingest"})


def test_bad_names_and_out_options_are_reported(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a:
            task: tasks.steps:fetch
            deps: {9lives: params.yaml}
            outs: [data/a]
          b:
            task: tasks.steps:fetch
            deps: {model: data/a}
            outs: {model: data/b}
          c:
            task: tasks.steps:fetch
            outs: [{data/c: {persist: true, cache: false}}]
    """)
    assert messages(spec) == [
        "stages.a.deps: '9lives' is not a name: start with a letter; letters, digits, _ and - only",
        "stages.b: the name 'model' is given to more than one path of deps, outs and metrics: a name finds one path",
        "stages.c.outs.0.cache: unknown key 'cache'; allowed: persist",
    ]
