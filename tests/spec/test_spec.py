"""Invalid specs (SPEC.md section 2) through ``load_project``, and ``conveyor validate``.

Every case writes a small spec into a real project in ``tmp_path`` and pins the message
the user reads: ``file:line key.path: what is wrong (did you mean ...)``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conveyor.errors import SpecError, SpecIssue
from conveyor.spec.base import size_in_bytes
from conveyor.spec.profiles import DaskProfile
from conveyor.spec.project import load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

# The console script of the interpreter running the tests (its venv), else the one on PATH.
BESIDE = Path(sys.executable).with_name("conveyor")
CONVEYOR = str(BESIDE) if BESIDE.exists() else (shutil.which("conveyor") or "conveyor")


def spec_error(path: Path, match: str) -> SpecError:
    with pytest.raises(SpecError, match=match) as info:
        load_project(path)
    return info.value


def only_issue(err: SpecError) -> SpecIssue:
    assert len(err.issues) == 1, str(err)
    return err.issues[0]


def issue_at(err: SpecError, key: str) -> SpecIssue:
    found = [i for i in err.issues if i.key == key]
    assert len(found) == 1, str(err)
    return found[0]


# --- a valid spec ---------------------------------------------------------------------


def test_good_spec_loads_with_its_graph_and_params(project: ProjectDir) -> None:
    loaded = load_project(project.good_spec())
    assert loaded.root == project.root
    assert list(loaded.pipeline.stages) == ["ingest", "prepare"]
    assert loaded.graph == {"ingest": frozenset(), "prepare": frozenset({"ingest"})}
    assert loaded.stage_params("ingest") == {"ingest": {"shards": 4, "url": "https://example.org/data.csv"}}


# --- unknown keys -----------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_close_one(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profile:
          io: {kind: threads}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    issue = only_issue(spec_error(spec, r"profile: unknown key 'profile' \(did you mean 'profiles'\?\)"))
    assert (issue.file, issue.line, issue.key) == (spec, 2, "profile")


def test_unknown_top_level_key_without_a_close_one_lists_the_allowed_keys(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
        colour: red
    """)
    issue = only_issue(spec_error(
        spec, r"colour: unknown key 'colour'; allowed: model, params, pipeline, profiles, stages, task_packages$"))
    assert (issue.line, issue.key) == (4, "colour")


def test_unknown_stage_key_suggests_the_close_one(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest:
            task: tasks.steps:fetch
            outs: [data/raw]
          prepare:
            task: tasks.steps:prepare
            dep: [data/raw]
    """)
    issue = only_issue(spec_error(spec, r"stages\.prepare\.dep: unknown key 'dep' \(did you mean 'deps'\?\)"))
    assert (issue.file, issue.line, issue.key) == (spec, 8, "stages.prepare.dep")


def test_unknown_profile_key_suggests_the_close_one_for_its_kind(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu: {kind: dask, n_worker: 2}
          gpu: {kind: dask-cuda, device: [0], fallback: cpu}
          io: {kind: threads, workers: 4}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    err = spec_error(spec, r"profiles\.cpu\.n_worker: unknown key 'n_worker' \(did you mean 'n_workers'\?\)")
    assert [(i.line, i.key) for i in err.issues] == [
        (3, "profiles.cpu.n_worker"), (4, "profiles.gpu.device"), (5, "profiles.io.workers")]
    assert issue_at(err, "profiles.gpu.device").message == "unknown key 'device' (did you mean 'devices'?)"
    assert issue_at(err, "profiles.io.workers").message == "unknown key 'workers' (did you mean 'max_workers'?)"


def test_unknown_profile_kind_suggests_the_close_one(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu:
            kind: daskk
            n_workers: 2
          nokind: {n_workers: 2}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    err = spec_error(spec, r"profiles\.cpu\.kind: unknown profile kind 'daskk' \(did you mean 'dask'\?\); "
                           r"kinds: threads, dask, dask-cuda, slurm")
    assert (issue_at(err, "profiles.cpu.kind").line, len(err.issues)) == (4, 2)
    missing = issue_at(err, "profiles.nokind")
    assert (missing.line, missing.message) == (6, "a profile needs 'kind' (threads, dask, dask-cuda, slurm)")


# --- unknown names ----------------------------------------------------------------------

# The SPEC.md example, with `on: gpuu` on line 14.
SPEC_EXAMPLE = """
    pipeline: breast-cancer
    params: params.yaml
    task_packages: [tasks]
    profiles:
      io:  {kind: threads, max_workers: 16}
      cpu: {kind: dask, n_workers: 2, threads_per_worker: 1, memory_limit: 4GiB}
      gpu: {kind: dask-cuda, fallback: cpu}
    stages:
      ingest:
        task: tasks.steps:fetch
        outs: [data/raw]
      train_xgb:
        task: tasks.steps:train
        on: gpuu
        deps: [data/raw]
        params: [train.xgb]
        outs: [models/xgb.json]
"""


def test_unknown_profile_in_on_names_file_line_key_and_the_close_profile(project: ProjectDir) -> None:
    spec = project.spec(SPEC_EXAMPLE)
    issue = only_issue(spec_error(spec, r"stages\.train_xgb\.on: unknown profile 'gpuu' \(did you mean 'gpu'\?\)"))
    assert (issue.file, issue.line, issue.key) == (spec, 14, "stages.train_xgb.on")
    assert str(issue).startswith(f"{spec}:14 stages.train_xgb.on: unknown profile 'gpuu' (did you mean 'gpu'?)")


def test_unknown_profile_line_is_exactly_the_spec_example(project: ProjectDir) -> None:
    spec = project.spec(SPEC_EXAMPLE)
    issue = only_issue(spec_error(spec, "unknown profile"))
    assert re.fullmatch(r"(.*/)?configs/pipeline\.yaml:14 stages\.train_xgb\.on: "
                        r"unknown profile 'gpuu' \(did you mean 'gpu'\?\)", str(issue)), str(issue)


def test_unknown_profile_without_a_close_one_lists_the_profiles(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          io: {kind: threads}
        stages:
          ingest: {task: "tasks.steps:fetch", on: hpc, outs: [data/raw]}
    """)
    issue = only_issue(spec_error(spec, r"stages\.ingest\.on: unknown profile 'hpc'; profiles: io$"))
    assert issue.line == 5


def test_unknown_needs_suggests_the_close_stage(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          prepare: {task: "tasks.steps:prepare", outs: [data/processed]}
          train:
            task: tasks.steps:train
            needs: [prepar]
    """)
    issue = only_issue(spec_error(spec, r"stages\.train\.needs\.0: unknown stage 'prepar' "
                                        r"\(did you mean 'prepare'\?\)"))
    assert issue.line == 6


def test_unknown_params_key_suggests_the_close_dotted_key(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          train:
            task: tasks.steps:train
            params: [train.xgb, train.xgb.max_dept]
    """)
    issue = only_issue(spec_error(
        spec, r"stages\.train\.params\.1: unknown param key 'train\.xgb\.max_dept' in params\.yaml "
              r"\(did you mean 'train\.xgb\.max_depth'\?\)"))
    assert issue.line == 5


def test_params_file_missing_is_reported_at_the_params_key(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        params: settings.yaml
        stages:
          ingest: {task: "tasks.steps:fetch", params: [ingest], outs: [data/raw]}
    """)
    err = spec_error(spec, re.escape(f"params: params file {project.root / 'settings.yaml'} not found; "
                                     "create it or fix 'params:'"))
    assert issue_at(err, "params").line == 2


def test_params_file_missing_is_fine_when_no_stage_reads_params(project: ProjectDir) -> None:
    (project.root / "params.yaml").unlink()
    loaded = load_project(project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """))
    assert loaded.params == {}


def test_bad_params_yaml_is_reported_in_the_params_file(project: ProjectDir) -> None:
    params = project.write("params.yaml", "ingest: {shards: 4\nx: 1\n")
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", params: [ingest], outs: [data/raw]}
    """)
    issue = only_issue(spec_error(spec, r"params\.yaml:2 not valid YAML"))
    assert (issue.file, issue.line) == (params, 2)


def test_bad_params_yaml_and_spec_problems_are_reported_together(project: ProjectDir) -> None:
    params = project.write("params.yaml", "ingest: {shards: 4\nx: 1\n")
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", on: nope, params: [ingest], outs: [data/raw]}
    """)
    err = spec_error(spec, "errors in")
    assert {i.file for i in err.issues} == {params, spec}


def test_params_yaml_is_read_as_yaml_1_2(project: ProjectDir) -> None:
    """DVC reads params as YAML 1.2: `on`, `yes` and `off` are strings, not booleans."""
    project.write("params.yaml", "ingest: {mode: on, keep: yes, flag: true}\n")
    loaded = load_project(project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", params: [ingest], outs: [data/raw]}
    """))
    assert loaded.stage_params("ingest") == {"ingest": {"mode": "on", "keep": "yes", "flag": True}}


# --- tasks ------------------------------------------------------------------------------


def test_unknown_task_module(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.no_such_module:fetch", outs: [data/raw]}
    """)
    issue = only_issue(spec_error(spec, re.escape(
        f"stages.ingest.task: unknown task 'tasks.no_such_module:fetch': module 'tasks.no_such_module' "
        f"not found under {project.root}")))
    assert issue.line == 3


def test_unknown_task_function_suggests_the_close_one(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          prepare: {task: "tasks.steps:prepar", outs: [data/processed]}
    """)
    spec_error(spec, r"stages\.prepare\.task: unknown task 'tasks\.steps:prepar': no function 'prepar' in steps\.py "
                     r"\(did you mean 'prepare'\?\)")


def test_task_that_is_not_module_colon_function(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          prepare: {task: tasks.steps.prepare, outs: [data/processed]}
    """)
    issue = only_issue(spec_error(spec, r"stages\.prepare\.task: 'tasks\.steps\.prepare' is not a task: "
                                        r"write it as module:function"))
    assert issue.line == 3


@pytest.mark.parametrize(("packages", "task", "listed"), [
    ("", "os.path:join", "tasks"),
    ("task_packages: [mytasks]\n", "tasks.steps:fetch", "mytasks"),
])
def test_task_outside_task_packages(project: ProjectDir, packages: str, task: str, listed: str) -> None:
    spec = project.spec(f"pipeline: demo\n{packages}stages:\n  ingest: {{task: \"{task}\", outs: [data/raw]}}\n")
    issue = only_issue(spec_error(spec, re.escape(
        f"stages.ingest.task: task '{task}' is outside task_packages ({listed}); move it or add its package")))
    assert issue.key == "stages.ingest.task"


def test_task_module_missing_from_the_project_is_not_found_elsewhere(
        project: ProjectDir, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        forget_packages: set[str]) -> None:
    """The project's ``convtasks`` package has no ``ghost`` module; another one on sys.path has."""
    forget_packages.add("convtasks")
    site = tmp_path_factory.mktemp("site")
    (site / "convtasks").mkdir()
    (site / "convtasks" / "__init__.py").write_text("")
    (site / "convtasks" / "ghost.py").write_text("def run(ctx):\n    return None\n")
    monkeypatch.syspath_prepend(str(site))
    project.write("convtasks/__init__.py", "")
    project.write("convtasks/real.py", "def run(ctx):\n    return None\n")
    spec = project.spec("""
        pipeline: demo
        task_packages: [convtasks]
        stages:
          ingest: {task: "convtasks.ghost:run", outs: [data/raw]}
    """)
    spec_error(spec, r"unknown task 'convtasks\.ghost:run'")


# --- the graph --------------------------------------------------------------------------


def test_two_stage_cycle_through_data_is_printed(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", deps: [data/y], outs: [data/x]}
          b: {task: "tasks.steps:prepare", deps: [data/x], outs: [data/y]}
    """)
    issue = only_issue(spec_error(spec, r"cycle: (a -> b -> a|b -> a -> b)$"))
    assert issue.key in ("stages.a", "stages.b")


def test_three_stage_cycle_is_reported_once(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", needs: [c]}
          b: {task: "tasks.steps:fetch", needs: [a]}
          c: {task: "tasks.steps:fetch", needs: [b]}
    """)
    issue = only_issue(spec_error(spec, r"cycle: "))
    names = issue.message.removeprefix("cycle: ").split(" -> ")
    assert len(names) == 4 and names[0] == names[-1] and set(names) == {"a", "b", "c"}
    assert (issue.key, issue.line) == (f"stages.{names[0]}", {"a": 3, "b": 4, "c": 5}[names[0]])


def test_three_stage_cycle_is_printed_in_data_flow_order(project: ProjectDir) -> None:
    """a needs c, b needs a, c needs b: data flows a -> b -> c -> a."""
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", needs: [c]}
          b: {task: "tasks.steps:fetch", needs: [a]}
          c: {task: "tasks.steps:fetch", needs: [b]}
    """)
    spec_error(spec, r"cycle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)$")


def test_two_stages_with_the_same_out(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          prepare: {task: "tasks.steps:prepare", outs: [data/processed]}
          again:
            task: tasks.steps:fetch
            outs: [data/other, data/processed]
    """)
    issue = only_issue(spec_error(spec, r"stages\.again\.outs: 'data/processed' is also written by stage 'prepare' "
                                        r"\('data/processed'\): every out has one producer"))
    assert issue.line == 6


def test_nested_outs_of_two_stages(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", outs: [data]}
          b: {task: "tasks.steps:fetch", metrics: [data/x]}
    """)
    issue = only_issue(spec_error(spec, r"stages\.b\.metrics: 'data/x' is also written by stage 'a' \('data'\)"))
    assert issue.line == 4


def test_same_out_spelled_two_ways(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          a: {task: "tasks.steps:fetch", outs: [./data/raw]}
          b: {task: "tasks.steps:prepare", outs: [data/raw]}
    """)
    spec_error(spec, r"'data/raw' is also written by stage 'a'")


@pytest.mark.parametrize(("path", "message"), [
    ("/etc/passwd", "'/etc/passwd' is absolute: paths are relative to the project root"),
    ("~/data.csv", "'~/data.csv' is absolute: paths are relative to the project root"),
    ("../outside.csv", "'../outside.csv' leaves the project: paths must stay inside the project root"),
    ("data/../../outside.csv", "'data/../../outside.csv' leaves the project: paths must stay inside the project root"),
    ("s3://bucket/key.csv", "'s3://bucket/key.csv' is a URL: deps and outs are project paths; put URLs in params"),
])
@pytest.mark.parametrize("field", ["deps", "outs", "metrics"])
def test_paths_must_be_relative_and_inside_the_project(project: ProjectDir, field: str, path: str,
                                                       message: str) -> None:
    spec = project.spec(f"""
        pipeline: demo
        stages:
          ingest:
            task: tasks.steps:fetch
            {field}: [data/ok, "{path}"]
    """)
    if field == "deps":
        project.write("data/ok", "")
    err = spec_error(spec, re.escape(f"stages.ingest.{field}.1: {message}"))
    assert issue_at(err, f"stages.ingest.{field}.1").line == 5


def test_dep_that_no_stage_writes_and_is_not_on_disk(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
          prepare:
            task: tasks.steps:prepare
            deps: [data/raw/part-0.csv, data/input.csv]
    """)
    issue = only_issue(spec_error(spec, r"stages\.prepare\.deps: 'data/input\.csv' does not exist and no stage "
                                        r"writes it"))
    assert issue.line == 6
    project.write("data/input.csv", "x\n")
    assert load_project(spec).graph["prepare"] == frozenset({"ingest"})


# --- YAML -------------------------------------------------------------------------------


def test_bad_yaml_syntax_reports_the_line(project: ProjectDir) -> None:
    spec = project.spec("pipeline: demo\nstages:\n  ingest:\n\ttask: tasks.steps:fetch\n")
    issue = only_issue(spec_error(spec, r":4 not valid YAML: found character '\\t' that cannot start any token"))
    assert (issue.file, issue.line, issue.key) == (spec, 4, "")


def test_bad_yaml_syntax_reports_the_column_too(project: ProjectDir) -> None:
    """As DVC does: a line may hold a whole flow mapping, and the column says where in it."""
    spec = project.spec("pipeline: demo\nstages:\n  ingest: {task: tasks.steps:fetch, outs: [data/raw}\n")
    issue = only_issue(spec_error(spec, "not valid YAML"))
    assert issue.line == 3
    assert issue.message == "not valid YAML: expected ',' or ']', but got '}' (column 52)"  # the '}' that closes no '['


def test_unclosed_flow_sequence_reports_a_line(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest:
            task: tasks.steps:fetch
            outs: [data/raw
          prepare:
            task: tasks.steps:prepare
    """)
    issue = only_issue(spec_error(spec, "not valid YAML"))
    assert issue.line is not None and 5 <= issue.line <= 7


def test_on_is_a_key_not_a_boolean(project: ProjectDir) -> None:
    """YAML 1.1 reads `on:` as True (and `yes` as True); the spec is YAML 1.2."""
    loaded = load_project(project.good_spec())
    assert loaded.pipeline.stages["ingest"].on == "io"
    spec = project.spec("""
        pipeline: demo
        profiles:
          io: {kind: threads}
        stages:
          ingest: {task: "tasks.steps:fetch", on: yes, outs: [data/raw]}
    """)
    spec_error(spec, r"stages\.ingest\.on: unknown profile 'yes'; profiles: io")


def test_empty_spec_is_an_error_with_a_line(project: ProjectDir) -> None:
    """An empty document is an error with a line, not a crash."""
    spec = project.spec("# nothing here\n")
    issue = only_issue(spec_error(spec, r"a spec is a mapping with 'pipeline' and 'stages'"))
    assert issue.line == 1


def test_two_stages_with_the_same_name(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
          ingest: {task: "tasks.steps:prepare", outs: [data/other]}
    """)
    spec_error(spec, r"stages\.ingest")


# --- values -----------------------------------------------------------------------------


def test_bad_memory_size(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu: {kind: dask, memory_limit: 4 gigs}
          gpu: {kind: dask-cuda, rmm_pool_size: lots, fallback: cpu}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    err = spec_error(spec, r"profiles\.cpu\.memory_limit: '4 gigs' is not a size: write it like 4GiB, 512MB or auto")
    assert [(i.line, i.key) for i in err.issues] == [
        (3, "profiles.cpu.memory_limit"), (4, "profiles.gpu.rmm_pool_size")]


@pytest.mark.parametrize("size", ["4GiB", "512MB", "1.5 GB", "auto", "100", "64kib"])
def test_good_memory_sizes(project: ProjectDir, size: str) -> None:
    loaded = load_project(project.spec(f"""
        pipeline: demo
        profiles:
          cpu: {{kind: dask, memory_limit: "{size}"}}
        stages:
          ingest: {{task: "tasks.steps:fetch", outs: [data/raw]}}
    """))
    assert loaded.pipeline.profiles["cpu"].memory_limit == size  # type: ignore[union-attr]


def test_bad_in_process_below_names_the_key(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu: {kind: dask, in_process_below: small}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    spec_error(spec, r"profiles\.cpu\.in_process_below: 'small' is not a size: write it like 64MiB or 500KB")


@pytest.mark.parametrize(("size", "expected"), [("64MiB", 64 * 2**20), ("500KB", 500_000), ("1.5 GB", 1_500_000_000),
                                                ("100", 100), ("2kib", 2048)])
def test_in_process_below_reads_sizes_as_dask_does(project: ProjectDir, size: str, expected: int) -> None:
    loaded = load_project(project.spec(f"""
        pipeline: demo
        profiles:
          cpu: {{kind: dask, n_workers: 2, in_process_below: "{size}"}}
        stages:
          ingest: {{task: "tasks.steps:fetch", outs: [data/raw]}}
    """))
    profile = loaded.pipeline.profiles["cpu"]
    assert isinstance(profile, DaskProfile) and size_in_bytes(str(profile.in_process_below)) == expected


def test_worker_env_names_the_key_and_applies_only_to_a_cluster_conveyor_starts(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu: {kind: dask, worker_env: {"OMP NUM": 1}}
          remote: {kind: dask, address: "tcp://127.0.0.1:8786", worker_env: {OMP_NUM_THREADS: 2}}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    err = spec_error(spec, r"profiles\.cpu\.worker_env: 'OMP NUM': not an environment variable name")
    assert "worker_env only apply to a LocalCluster started by conveyor" in str(err)


def test_no_workers_timeout_defaults_to_a_minute_and_must_be_positive(project: ProjectDir) -> None:
    loaded = load_project(project.spec("""
        pipeline: demo
        profiles:
          remote: {kind: dask, address: "tcp://127.0.0.1:8786", no_workers_timeout_s: 5}
          cpu: {kind: dask, n_workers: 2}
          patient: {kind: dask, no_workers_timeout_s: null}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """))
    timeouts = {n: getattr(p, "no_workers_timeout_s", "?") for n, p in loaded.pipeline.profiles.items()}
    assert timeouts == {"remote": 5.0, "cpu": 60.0, "patient": None}
    spec = project.spec("""
        pipeline: demo
        profiles:
          remote: {kind: dask, address: "tcp://127.0.0.1:8786", no_workers_timeout_s: 0}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    spec_error(spec, r"profiles\.remote\.no_workers_timeout_s: Input should be greater than 0 \(got 0\)")


def test_negative_retries_and_zero_timeout(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest:
            task: tasks.steps:fetch
            outs: [data/raw]
            retries: -1
            timeout_s: 0
    """)
    err = spec_error(spec, r"stages\.ingest\.retries: Input should be greater than or equal to 0 \(got -1\)")
    assert issue_at(err, "stages.ingest.retries").line == 6
    assert issue_at(err, "stages.ingest.timeout_s").message == "Input should be greater than 0 (got 0)"


def test_bad_fallback(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          cpu: {kind: dask}
          gpu: {kind: dask-cuda, fallback: cpux}
          gpu2: {kind: dask-cuda, fallback: gpu}
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw]}
    """)
    err = spec_error(spec, r"profiles\.gpu\.fallback: unknown fallback 'cpux': use error, cpu or a profile name "
                           r"\(did you mean 'cpu'\?\)")
    assert issue_at(err, "profiles.gpu.fallback").line == 4
    gpu2 = issue_at(err, "profiles.gpu2.fallback")
    assert (gpu2.line, gpu2.message) == (5, "fallback 'gpu' is itself a GPU profile")


# --- every problem at once --------------------------------------------------------------


def test_every_problem_is_reported_in_one_error(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        profiles:
          io: {kind: threads}
        stages:
          ingest:
            task: tasks.steps:fetchh
            on: ioo
            params: [ingest.shard]
            outs: [/data/raw]
          prepare:
            task: os.path:join
            needs: [ingestt]
            deps: [data/nothing.csv]
    """)
    err = spec_error(spec, "7 errors")
    assert str(err).splitlines()[0] == f"7 errors in {spec}:"
    assert [(i.line, i.key) for i in err.issues] == [
        (6, "stages.ingest.task"), (7, "stages.ingest.on"), (8, "stages.ingest.params.0"),
        (9, "stages.ingest.outs.0"), (11, "stages.prepare.task"), (12, "stages.prepare.needs.0"),
        (13, "stages.prepare.deps"),
    ]
    assert all(i.file == spec for i in err.issues)
    assert str(err).splitlines()[1:] == [f"  {i}" for i in err.issues]


def test_structural_and_graph_problems_are_reported_together(project: ProjectDir) -> None:
    spec = project.spec("""
        pipeline: demo
        stages:
          ingest: {task: "tasks.steps:fetch", outs: [data/raw], retries: -1}
          prepare: {task: "tasks.steps:prepare", deps: [data/missing.csv], outs: [data/raw]}
    """)
    err = spec_error(spec, "errors in")
    assert {i.key for i in err.issues} == {"stages.ingest.retries", "stages.prepare.deps", "stages.prepare.outs"}


# --- conveyor validate ------------------------------------------------------------------


def validate(cwd: Path, *args: str, columns: int | None = 1000) -> subprocess.CompletedProcess[str]:
    """Run the real console script; ``columns`` sets COLUMNS (None: what a pipe gets by default)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([CONVEYOR, "validate", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


BAD_SPEC = SPEC_EXAMPLE.replace("outs: [data/raw]", "outs: [data/raw]\n        retries: -1")


def test_validate_bad_spec_exits_2_listing_every_problem_without_traceback(project: ProjectDir) -> None:
    spec = project.spec(BAD_SPEC)
    done = validate(project.root, "-c", "configs/pipeline.yaml")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == f"2 errors in {spec}:"
    assert lines[1] == f"  {spec}:12 stages.ingest.retries: Input should be greater than or equal to 0 (got -1)"
    assert lines[2].startswith(f"  {spec}:15 stages.train_xgb.on: unknown profile 'gpuu' (did you mean 'gpu'?)")


def test_validate_errors_are_one_line_each_on_a_pipe(project: ProjectDir) -> None:
    spec = project.spec(BAD_SPEC)
    done = validate(project.root, "-c", "configs/pipeline.yaml", columns=None)
    assert done.returncode == 2
    assert done.stderr.splitlines()[:2] == [
        f"2 errors in {spec}:",
        f"  {spec}:12 stages.ingest.retries: Input should be greater than or equal to 0 (got -1)"]


def test_validate_good_spec_exits_0(project: ProjectDir) -> None:
    project.good_spec()
    done = validate(project.root, "-c", "configs/pipeline.yaml")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == "configs/pipeline.yaml: ok (2 stages, 3 profiles)"


def test_validate_finds_the_spec_from_a_subdirectory(project: ProjectDir) -> None:
    project.good_spec()
    done = validate(project.root / "tasks")
    assert done.returncode == 0, done.stderr
    assert "ok (2 stages" in done.stdout


def test_validate_with_a_missing_spec_file_is_a_usage_error(project: ProjectDir) -> None:
    done = validate(project.root, "-c", "configs/nope.yaml")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == f"spec file {project.root / 'configs/nope.yaml'} not found (pass -c FILE)"


HEAVY_IMPORT_CHECK = """
import json, sys
from typer.testing import CliRunner
import conveyor.cli.app

good = CliRunner().invoke(conveyor.cli.app.app, ["validate", "-c", sys.argv[1]])
sys.argv = ["conveyor", "validate", "-c", sys.argv[2]]
try:
    conveyor.cli.app.main()
    bad = 0
except SystemExit as exc:
    bad = exc.code
heavy = {"prefect", "dask", "distributed", "torch", "xgboost", "sklearn", "dask_cuda", "pandas", "pyarrow"}
print(json.dumps({"good": good.exit_code, "bad": bad,
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in heavy)}))
"""


def test_validate_imports_nothing_heavy(project: ProjectDir) -> None:
    good = project.good_spec()
    bad = project.spec(SPEC_EXAMPLE, rel="configs/bad.yaml")
    done = subprocess.run([sys.executable, "-c", HEAVY_IMPORT_CHECK, str(good), str(bad)], cwd=project.root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"good": 0, "bad": 2, "heavy": []}
