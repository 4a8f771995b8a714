"""Hostile and broken specs, params files and dvc.yaml files: each is refused with exit 2 and
one line per problem naming ``file:line key.path``, in well under two seconds, never a traceback,
a hang or a crash (SPEC.md §2.1, §2.3, §4).

The corpus covers YAML that would hang or crash a loader (a "billion laughs" document, nesting
that overflows libyaml's C composer, a 10 MB file), YAML that is not YAML (bad syntax, tabs,
bytes that are not UTF-8, tags that build Python objects), every level of the spec in the wrong
shape, and specs that are well formed but wrong (cycles, two producers of one out, paths that
leave the project, through ``..``, an absolute path or a symbolic link, a task from Python's
standard library). Every case goes through ``load_project`` in-process; the ones a loader could
hang or crash on also go through the real ``conveyor validate``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from repos import git_dvc_init

from conveyor.errors import SpecError, SpecIssue
from conveyor.spec.project import load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

# The console script of the interpreter running the tests (its venv), else the one on PATH,
# as tests/spec/test_spec.py finds it.
BESIDE = Path(sys.executable).with_name("conveyor")
CONVEYOR = str(BESIDE) if BESIDE.exists() else (shutil.which("conveyor") or "conveyor")

# Each case takes well under 2 s (most under 0.1 s in-process, ~0.4 s as a process); the bound
# is generous for a loaded two-core CI machine, and still far below a hang.
WALL_S = 5.0
SPEC = "configs/pipeline.yaml"
TASK = "task: tasks.steps:fetch"
NOT_A_SPEC = "a spec is a mapping with 'pipeline' and 'stages'"


def laughs(indent: str = "") -> str:
    """A "billion laughs": nine levels of anchors, each a list of nine aliases of the one before
    (9^9 strings once expanded), as YAML lines at ``indent``; the aliases start on line 2."""
    lines = [f"{indent}l0: &l0 [{', '.join(['lol'] * 9)}]"]
    lines += [f"{indent}l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 9)]
    return "\n".join(lines) + "\n"


def nested_flow(depth: int, *, closed: bool = True) -> str:
    return "[" * depth + ("]" * depth if closed else "")


def stage_spec(body: str, head: str = "") -> str:
    """A spec with one stage ``s`` whose flow mapping holds ``body``: line 3 (after ``head``)."""
    return f"pipeline: hostile\n{head}stages:\n  s: {{{body}}}\n"


@dataclass(frozen=True)
class Case:
    """A project with one hostile file, and the issue it must be refused with.

    ``files``: path (relative to the project root) -> content, written over the project
    (``conftest.ProjectDir``: tasks/steps.py and params.yaml); ``links``: path -> target, where
    ``{outside}`` is a directory outside the project. The issue: ``file`` it names (relative),
    its ``line``, its ``key`` and a fragment of its message (``says``).
    """

    id: str
    files: Mapping[str, str | bytes]
    file: str
    line: int | None
    key: str
    says: str
    links: Mapping[str, str] = field(default_factory=dict)
    dirs: tuple[str, ...] = ()
    cli: bool = False  # also run `conveyor validate` on it


SPEC_CASES = [
    # --- YAML a loader could hang or crash on -----------------------------------------------
    Case("billion-laughs", {SPEC: laughs() + "pipeline: hostile\nstages:\n  s: {" + TASK + "}\n"}, SPEC, 5, "l4.5",
         "aliases expand the document past 50,000 values (at '*l3'): a YAML bomb", cli=True),
    Case("billion-laughs-in-params", {SPEC: stage_spec(TASK + ", params: [l8]"), "params.yaml": laughs()},
         "params.yaml", 5, "l4.5", "aliases expand the document past 50,000 values", cli=True),
    Case("alias-of-itself", {SPEC: stage_spec(TASK + ", outs: &o [a, *o]")}, SPEC, 3, "stages.s.outs.1",
         "alias '*o' lies inside the node it names: a structure that contains itself", cli=True),
    Case("10MB-spec", {SPEC: stage_spec(TASK) + "".join(f"k{i}: {'x' * 90}\n" for i in range(110_000))}, SPEC, None,
         "", "is larger than 2 MiB: a file this big is data, not configuration", cli=True),
    Case("60k-values", {SPEC: stage_spec(TASK + ", outs: [" + ",".join(["a"] * 60_000) + "]")}, SPEC, 3,
         "stages.s.outs.49989", "holds more than 50,000 values", cli=True),
    Case("10k-nested-lists", {SPEC: stage_spec(TASK + ", outs: " + nested_flow(10_000))}, SPEC, 3,
         "stages.s.outs.0.0.0....", "nested more than 100 levels deep", cli=True),
    Case("100k-unclosed-lists", {SPEC: stage_spec(TASK + ", outs: " + nested_flow(100_000, closed=False))},
         SPEC, 3, "stages.s.outs.0.0.0....", "nested more than 100 levels deep", cli=True),
    Case("10k-nested-mappings", {SPEC: stage_spec(TASK, head="x: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n")},
         SPEC, 2, "x.a.a.a.a.a....", "nested more than 100 levels deep", cli=True),
    Case("10k-nested-block-lists", {SPEC: stage_spec(TASK), "params.yaml": "a:\n" + "- " * 10_000 + "1\n"},
         "params.yaml", 2, "a.0.0.0.0.0....", "nested more than 100 levels deep", cli=True),
    # --- not YAML, or YAML that would build objects --------------------------------------------
    Case("unclosed-flow", {SPEC: "pipeline: hostile\nstages:\n  s: {task: tasks.steps:fetch, outs: [a\n"}, SPEC, 4,
         "", "not valid YAML: expected ',' or ']', but got '<stream end>'"),
    Case("tab-indent", {SPEC: "pipeline: hostile\nstages:\n\ts: {" + TASK + "}\n"}, SPEC, 3, "",
         "not valid YAML: found character '\\t' that cannot start any token"),
    Case("not-utf8", {SPEC: b"pipeline: hostile\nstages:\n  s: {task: tasks.steps:f\xffetch}\n"}, SPEC, 3, "",
         "is not UTF-8 text: byte 0xff at column 26; save it as UTF-8", cli=True),
    Case("nul-byte", {SPEC: "pipeline: hostile\nstages:\n  s: {task: tasks.steps:f\x00}\n"}, SPEC, 3, "",
         "not valid YAML: character #x0000 is not allowed in YAML"),
    Case("two-documents", {SPEC: stage_spec(TASK) + "---\npipeline: again\n"}, SPEC, 4, "",
         "not valid YAML: but found another document"),
    Case("python-object-tag", {SPEC: stage_spec(TASK).replace("s: {", "s: !!python/object:os.system {")}, SPEC, 3,
         "stages.s", "tag '!!python/object:os.system' is not allowed: conveyor reads plain YAML", cli=True),
    Case("python-name-tag", {SPEC: "pipeline: !!python/name:os.system\nstages:\n  s: {" + TASK + "}\n"}, SPEC, 1,
         "pipeline", "tag '!!python/name:os.system' is not allowed"),
    Case("custom-tag", {SPEC: stage_spec(TASK + ", outs: !include other.yaml")}, SPEC, 3, "stages.s.outs",
         "tag '!include' is not allowed"),
    Case("undefined-alias", {SPEC: stage_spec(TASK + ", outs: *nope")}, SPEC, 3, "",
         "not valid YAML: found undefined alias 'nope'"),
    Case("spec-is-a-directory", {}, SPEC, None, "", "is a directory: expected a YAML file", dirs=(SPEC,)),
    Case("params-is-a-directory", {SPEC: stage_spec(TASK + ", params: [a]")}, SPEC, 1, "params",
         "params.yaml is a directory: name the params file", dirs=("params.yaml",)),
    # --- every level in the wrong shape --------------------------------------------------------
    Case("spec-a-list", {SPEC: "- pipeline\n- stages\n"}, SPEC, 1, "", NOT_A_SPEC),
    Case("spec-a-scalar", {SPEC: "42\n"}, SPEC, 1, "", NOT_A_SPEC),
    Case("spec-empty", {SPEC: ""}, SPEC, 1, "", NOT_A_SPEC),
    Case("stages-a-list", {SPEC: "pipeline: hostile\nstages: [a, b]\n"}, SPEC, 2, "stages",
         "Input should be a valid dictionary (got ['a', 'b'])"),
    Case("stages-a-number", {SPEC: "pipeline: hostile\nstages: 5\n"}, SPEC, 2, "stages",
         "Input should be a valid dictionary (got 5)", cli=True),
    Case("stage-a-string", {SPEC: "pipeline: hostile\nstages:\n  s: hello\n"}, SPEC, 3, "stages.s",
         "Input should be a valid dictionary or instance of Stage (got 'hello')"),
    Case("stage-null", {SPEC: "pipeline: hostile\nstages:\n  s:\n"}, SPEC, 3, "stages.s",
         "Input should be a valid dictionary or instance of Stage (got None)"),
    Case("outs-a-mapping-of-numbers", {SPEC: stage_spec(TASK + ", outs: {a: 1, b: 2}")}, SPEC, 3, "stages.s.outs",
         "'a' must be a path or {path: ..., persist: true}"),
    Case("outs-of-lists", {SPEC: stage_spec(TASK + ", outs: [[a]]")}, SPEC, 3, "stages.s.outs.0",
         "Input should be a valid dictionary or instance of Declared (got ['a'])"),
    Case("profiles-a-list", {SPEC: stage_spec(TASK, head="profiles: [cpu]\n")}, SPEC, 2, "profiles",
         "Input should be a valid dictionary (got ['cpu'])"),
    Case("profile-a-number", {SPEC: stage_spec(TASK, head="profiles:\n  cpu: 4\n")}, SPEC, 3, "profiles.cpu",
         "Input should be a valid dictionary or object to extract fields from (got 4)"),
    Case("task-packages-a-string", {SPEC: stage_spec(TASK, head="task_packages: tasks\n")}, SPEC, 2, "task_packages",
         "Input should be a valid tuple (got 'tasks')"),
    Case("params-key-a-list", {SPEC: stage_spec(TASK, head="params: [params.yaml]\n")}, SPEC, 2, "params",
         "Input should be a valid string (got ['params.yaml'])"),
    Case("params-file-a-list", {SPEC: stage_spec(TASK + ", params: [a]"), "params.yaml": "- a\n- b\n"},
         "params.yaml", 1, "", "a params file is a mapping of keys to values"),
    Case("params-file-a-scalar", {SPEC: stage_spec(TASK + ", params: [a]"), "params.yaml": "3\n"},
         "params.yaml", 1, "", "a params file is a mapping of keys to values"),
    Case("infinite-timeout", {SPEC: stage_spec(TASK + ", timeout_s: .inf")}, SPEC, 3, "stages.s.timeout_s",
         "Input should be a finite number (got inf)"),
    Case("huge-wrong-value-is-shown-short", {SPEC: stage_spec(TASK + ", retries: '" + "x" * 500_000 + "'")}, SPEC, 3,
         "stages.s.retries", "unable to parse string as an integer (got 'xxxxxxxxxx"),
    # --- well formed, but wrong ----------------------------------------------------------------
    Case("unknown-top-level-key", {SPEC: stage_spec(TASK, head="stagse: {}\n")}, SPEC, 2, "stagse",
         "unknown key 'stagse' (did you mean 'stages'?)"),
    Case("unknown-stage-key", {SPEC: stage_spec(TASK + ", ouputs: [a]")}, SPEC, 3, "stages.s.ouputs",
         "unknown key 'ouputs'"),
    Case("empty-matrix", {SPEC: stage_spec(TASK + ", matrix: {}")}, SPEC, 3, "stages.s.matrix",
         "a matrix is a mapping of names to lists of values"),
    Case("matrix-of-a-million", {SPEC: stage_spec(TASK + ", matrix: {a: [" + ",".join(map(str, range(1000)))
                                                  + "], b: [" + ",".join(map(str, range(1000))) + "]}")},
         SPEC, 3, "stages.s.matrix", "1,000,000 combinations: more than 10,000 stages"),
    Case("task-and-cmd", {SPEC: stage_spec(TASK + ", cmd: echo hi")}, SPEC, 3, "stages.s",
         "a stage runs a task (module:function) or a cmd (a shell command): give exactly one"),
    Case("neither-task-nor-cmd", {SPEC: stage_spec("outs: [a]")}, SPEC, 3, "stages.s",
         "a stage runs a task (module:function) or a cmd (a shell command): give exactly one"),
    Case("missing-task-module", {SPEC: stage_spec("task: tasks.nope:fetch")}, SPEC, 3, "stages.s.task",
         "unknown task 'tasks.nope:fetch': module 'tasks.nope' not found"),
    Case("missing-task-function", {SPEC: stage_spec("task: tasks.steps:fech")}, SPEC, 3, "stages.s.task",
         "no function 'fech' in steps.py (did you mean 'fetch'?)"),
    Case("stdlib-task", {SPEC: stage_spec("task: shutil:rmtree", head="task_packages: [shutil]\n")}, SPEC, 4,
         "stages.s.task", "task 'shutil:rmtree': 'shutil' is a module of Python's standard library", cli=True),
    Case("stdlib-task-package", {SPEC: stage_spec("task: os.path:join", head="task_packages: [tasks, os]\n")}, SPEC, 2,
         "task_packages.1", "'os' is a module of Python's standard library: a task comes from the project's own"),
    Case("cycle", {SPEC: "pipeline: hostile\nstages:\n  a: {" + TASK + ", deps: [b], outs: [a]}\n"
                   "  b: {" + TASK + ", deps: [a], outs: [b]}\n"}, SPEC, 3, "stages.a", "cycle: a -> b -> a"),
    Case("same-out-twice", {SPEC: "pipeline: hostile\nstages:\n  a: {" + TASK + ", outs: [data/x]}\n"
                            "  b: {" + TASK + ", outs: [./data/x]}\n"}, SPEC, 4, "stages.b.outs",
         "'data/x' is also written by stage 'a' ('data/x'): every out has one producer"),
    Case("dotdot-out", {SPEC: stage_spec(TASK + ", outs: [data/../../escaped.txt]")}, SPEC, 3, "stages.s.outs.0",
         "'data/../../escaped.txt' leaves the project"),
    Case("absolute-dep", {SPEC: stage_spec(TASK + ", deps: [/etc/passwd], outs: [a]")}, SPEC, 3, "stages.s.deps.0",
         "'/etc/passwd' is absolute"),
    Case("absolute-params-file", {SPEC: stage_spec(TASK + ", params: [root]", head="params: /etc/passwd\n")}, SPEC, 2,
         "params", "'/etc/passwd' is absolute"),
    Case("out-through-symlinked-dir", {SPEC: stage_spec(TASK + ", outs: [data/r/link/escaped.txt]")}, SPEC, 3,
         "stages.s.outs.0", "'data/r/link/escaped.txt' leaves the project through the symbolic link 'data/r/link' -> "
         "'{outside}'", links={"data/r/link": "{outside}"}, cli=True),
    Case("dep-through-symlinked-dir", {SPEC: stage_spec(TASK + ", deps: [data/link/secret], outs: [a]")}, SPEC, 3,
         "stages.s.deps.0", "leaves the project through the symbolic link 'data/link'",
         links={"data/link": "{outside}"}),
    Case("out-is-a-symlinked-dir", {SPEC: stage_spec(TASK + ", outs: [data/link]")}, SPEC, 3, "stages.s.outs.0",
         "leaves the project through the symbolic link 'data/link'", links={"data/link": "{outside}"}),
    Case("wdir-through-symlink", {SPEC: stage_spec("cmd: echo hi > x, wdir: out, outs: [x]")}, SPEC, 3,
         "stages.s.wdir", "'out' leaves the project through the symbolic link 'out'", links={"out": "{outside}"}),
    Case("control-character-in-path", {SPEC: stage_spec(TASK + ', outs: ["a\\x00b"]')}, SPEC, 3, "stages.s.outs.0",
         "'a\\x00b' holds a control character"),
    Case("out-inside-git", {SPEC: stage_spec(TASK + ", outs: [.git/hooks/pre-commit]")}, SPEC, 3, "stages.s.outs.0",
         "'.git/hooks/pre-commit' is inside .git/, which belongs to git"),
    Case("unknown-interpolation", {SPEC: stage_spec("cmd: 'echo ${train.xgb.depth}', outs: [a]")}, SPEC, 3,
         "stages.s.cmd", "unknown param key '${train.xgb.depth}'"),
    Case("interpolated-mapping", {SPEC: stage_spec("cmd: 'echo ${train}', outs: [a]")}, SPEC, 3, "stages.s.cmd",
         "'${train}' is a mapping: interpolate a single value"),
]


def make(root: Path, case: Case, outside: Path) -> None:
    for rel, content in case.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    for rel in case.dirs:
        (root / rel).unlink(missing_ok=True)
        (root / rel).mkdir(parents=True, exist_ok=True)
    for rel, target in case.links.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(target.format(outside=outside))


def expected(case: Case, outside: Path) -> str:
    return case.says.format(outside=outside) if case.links else case.says


def the_issue(err: SpecError, root: Path, case: Case, outside: Path) -> SpecIssue:
    """The one issue of ``err`` that ``case`` expects: same file, line, key, and its words."""
    found = [i for i in err.issues if i.key == case.key and expected(case, outside) in i.message]
    assert len(found) == 1, f"{case.id}: no single issue at {case.key!r} saying {case.says!r} in\n{err}"
    issue = found[0]
    assert (issue.file, issue.line) == (root / case.file, case.line), str(issue)
    return issue


def timed(load: Callable[[], object]) -> tuple[SpecError, float]:
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load()
    return info.value, time.perf_counter() - start


@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside every project: what a symbolic link in a hostile project points to."""
    return tmp_path_factory.mktemp("outside").resolve()


def test_the_corpus_is_large_and_its_names_unique() -> None:
    names = [c.id for c in SPEC_CASES + DVC_CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)


@pytest.mark.parametrize("case", SPEC_CASES, ids=lambda c: c.id)
def test_a_hostile_spec_is_refused_quickly_naming_file_line_and_key(
        project: ProjectDir, outside: Path, case: Case) -> None:
    make(project.root, case, outside)
    err, wall = timed(lambda: load_project(project.root / SPEC))
    assert err.exit_code == 2
    the_issue(err, project.root, case, outside)
    assert wall < WALL_S, f"{case.id}: {wall:.2f}s"
    assert all(len(str(issue)) < 1_000 for issue in err.issues), "each problem is one readable line"
    assert list(outside.iterdir()) == []


# --- the real command line -------------------------------------------------------------------


def validate(cwd: Path, spec: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    done = subprocess.run([CONVEYOR, "validate", "-c", spec], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "1000"})
    return done, time.perf_counter() - start


def refused(done: subprocess.CompletedProcess[str], wall: float, where: str, says: str) -> None:
    """Exit 2, nothing on stdout, the issue as one line on stderr, no traceback, in time."""
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert any(line.startswith(f"  {where}") and says in line for line in done.stderr.splitlines()), done.stderr
    assert wall < WALL_S, f"{wall:.2f}s"


@pytest.mark.parametrize("case", [c for c in SPEC_CASES if c.cli], ids=lambda c: c.id)
def test_conveyor_validate_refuses_it_with_exit_2_and_no_traceback(
        project: ProjectDir, outside: Path, case: Case) -> None:
    make(project.root, case, outside)
    done, wall = validate(project.root, SPEC)
    line = f":{case.line}" if case.line is not None else ""
    key = f" {case.key}:" if case.key else ""
    refused(done, wall, f"{project.root / case.file}{line}{key}", expected(case, outside))


def test_a_spec_that_is_a_directory_is_a_usage_error(project: ProjectDir) -> None:
    (project.root / "configs/pipeline.yaml").mkdir(parents=True)
    done, wall = validate(project.root, SPEC)
    assert done.returncode == 2 and "Traceback" not in done.stderr and wall < WALL_S
    assert done.stderr.strip() == f"spec file {project.root / SPEC} is a directory (pass -c FILE: a spec or a dvc.yaml)"


# --- what is not hostile stays valid ---------------------------------------------------------


def test_anchors_and_merge_keys_within_bounds_still_load(project: ProjectDir) -> None:
    """300 stages sharing the first one's settings through ``<<: *defaults``: aliases as configuration uses them."""
    stages = "".join(f"  s{i}:\n    <<: *defaults\n    outs: [data/s{i}.txt]\n" for i in range(1, 300))
    spec = project.spec(f"pipeline: anchors\nstages:\n  s0: &defaults\n    {TASK}\n    retries: 1\n"
                        f"    outs: [data/s0.txt]\n{stages}")
    loaded = load_project(spec)
    assert len(loaded.pipeline.stages) == 300
    assert {s.retries for s in loaded.pipeline.stages.values()} == {1}
    assert loaded.pipeline.stages["s299"].outs == ("data/s299.txt",)


def test_a_link_to_a_file_outside_and_a_link_inside_are_fine(project: ProjectDir, outside: Path) -> None:
    """DVC's cache links (``cache.type: symlink``) point anywhere; a link within the project stays in it."""
    (outside / "cached.csv").write_text("a,b\n")
    (project.root / "data/real").mkdir(parents=True)
    (project.root / "data/cached.csv").symlink_to(outside / "cached.csv")
    (project.root / "data/alias").symlink_to(project.root / "data/real")
    project.spec(stage_spec(TASK + ", deps: [data/cached.csv], outs: [data/alias/out.txt]"))
    assert load_project(project.root / SPEC).pipeline.stages["s"].outs == ("data/alias/out.txt",)


def big_spec(n: int, shape: str) -> str:
    """``n`` stages: a chain (each reads the one before) or a fan-out (one root, n-2 leaves, one join)."""
    if shape == "chain":
        return "pipeline: chain\nstages:\n" + "".join(
            f"  s{i}:\n    {TASK}\n    deps: [{f'data/s{i - 1}.txt' if i else 'tasks/steps.py'}]\n"
            f"    outs: [data/s{i}.txt]\n" for i in range(n))
    leaves = "".join(f"  leaf{i}:\n    cmd: echo {i} > data/leaves/{i}.txt\n    deps: [data/root.txt]\n"
                     f"    outs: [data/leaves/{i}.txt]\n" for i in range(n - 2))
    return (f"pipeline: fan\nstages:\n  root:\n    {TASK}\n    outs: [data/root.txt]\n{leaves}"
            f"  join:\n    {TASK}\n    deps: [data/leaves]\n    outs: [data/joined.txt]\n")


@pytest.mark.parametrize("shape", ["chain", "fan-out"])
def test_a_300_stage_spec_validates_quickly(project: ProjectDir, shape: str) -> None:
    project.spec(big_spec(300, shape))
    start = time.perf_counter()
    loaded = load_project(project.root / SPEC)
    wall = time.perf_counter() - start
    assert len(loaded.pipeline.stages) == 300
    if shape == "chain":
        assert loaded.order[:3] == ["s0", "s1", "s2"] and loaded.graph["s299"] == frozenset({"s298"})
    else:
        assert len(loaded.graph["join"]) == 298 and loaded.graph["leaf7"] == frozenset({"root"})
    assert wall < WALL_S, f"{wall:.2f}s"
    done, wall = validate(project.root, SPEC)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "configs/pipeline.yaml: ok (300 stages, 0 profiles)"
    assert wall < WALL_S, f"{wall:.2f}s"


# --- dvc.yaml, read through DVC's own loader ---------------------------------------------------


DVC = "dvc.yaml"
DVC_CASES = [
    Case("dvc-billion-laughs", {DVC: "stages:\n  s:\n    cmd: echo hi\n" + laughs()}, DVC, 8, "l4.5",
         "aliases expand the document past 50,000 values", cli=True),
    Case("dvc-billion-laughs-in-vars",
         {DVC: "vars:\n  - " + laughs("    ").lstrip() + "stages:\n  s:\n    cmd: echo hi\n"}, DVC, 6, "vars.0.l4.5",
         "aliases expand the document past 50,000 values", cli=True),
    Case("dvc-billion-laughs-in-params", {DVC: "stages:\n  s:\n    cmd: echo ${l8}\n", "params.yaml": laughs()},
         "params.yaml", 5, "l4.5", "aliases expand the document past 50,000 values", cli=True),
    Case("dvc-billion-laughs-in-vars-file", {DVC: "vars: [more.yaml]\nstages:\n  s:\n    cmd: echo hi\n",
                                             "more.yaml": laughs()},
         "more.yaml", 5, "l4.5", "aliases expand the document past 50,000 values"),
    Case("dvc-50k-nested-lists", {DVC: "stages:\n  s:\n    cmd: echo hi\n    outs: " + nested_flow(50_000) + "\n"},
         DVC, 4, "stages.s.outs.0.0.0....", "nested more than 100 levels deep", cli=True),
    Case("dvc-stages-a-list", {DVC: "stages: [a, b]\n"}, DVC, 1, "stages", "expected a dictionary"),
    Case("dvc-empty-matrix", {DVC: "stages:\n  t:\n    matrix: {}\n    cmd: echo hi\n"}, DVC, 3, "stages.t.matrix",
         "an empty matrix: it expands to no stage", cli=True),
    Case("dvc-matrix-with-an-empty-list", {DVC: "stages:\n  t:\n    matrix:\n      lr: []\n      depth: [1]\n"
                                           "    cmd: echo ${item.lr}\n"}, DVC, 4, "stages.t.matrix.lr",
         "an empty list: the matrix expands to no stage"),
    Case("dvc-params-file-of-a-number", {DVC: "stages:\n  t:\n    cmd: echo\n    params: [{p.yaml: 5}]\n"}, DVC, 1,
         "stages", "DVC cannot load it: Expected list of params for custom params file 'p.yaml', got 'int'", cli=True),
    Case("dvc-wdir-outside", {DVC: "stages:\n  t:\n    cmd: echo hi\n    wdir: ../..\n"}, DVC, 4, "stages.t.wdir",
         "lies outside the repository"),
    Case("dvc-python-tag", {DVC: "stages:\n  t:\n    cmd: !!python/object/apply:os.system [echo]\n"}, DVC, 3,
         "stages.t.cmd", "tag '!!python/object/apply:os.system' is not allowed"),
    Case("dvc-out-through-symlinked-dir", {DVC: "stages:\n  t:\n    cmd: echo hi > data/link/escaped.txt\n"
                                           "    outs: [data/link/escaped.txt]\n"}, DVC, 4, "stages.t.outs",
         "leaves the project through the symbolic link", links={"data/link": "{outside}"}, cli=True),
]


@pytest.fixture(scope="module")
def dvc_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git + DVC repository, made once for the module and copied for each case."""
    return git_dvc_init(tmp_path_factory.mktemp("hostile-dvc").resolve())


@pytest.fixture
def dvc_repo(dvc_template: Path, tmp_path: Path) -> Path:
    """A repository of the case's own: conveyor reads every DVC file of a repository, as `dvc
    repro` does, so one case's bomb in a shared repository would be another case's too."""
    return Path(shutil.copytree(dvc_template, tmp_path.resolve() / "repo", symlinks=True))


@pytest.mark.parametrize("case", DVC_CASES, ids=lambda c: c.id)
def test_a_hostile_dvc_yaml_is_refused_before_dvc_reads_it(dvc_repo: Path, outside: Path, case: Case) -> None:
    """DVC itself hangs on the bombs, crashes (SIGSEGV) on the nesting, fails an assertion on the
    empty matrix and, for the link, runs the command (writing outside) before refusing the out."""
    folder = dvc_repo / f"{case.id}-{uuid.uuid4().hex[:6]}"
    make(folder, case, outside)
    err, wall = timed(lambda: load_project(folder / DVC))
    the_issue(err, folder, case, outside)
    assert wall < WALL_S, f"{case.id}: {wall:.2f}s"
    if case.cli:
        done, wall = validate(folder, DVC)
        line = f":{case.line}" if case.line is not None else ""
        refused(done, wall, f"{folder / case.file}{line} {case.key}:", expected(case, outside))
    assert list(outside.iterdir()) == []


def test_a_metrics_file_or_prefect_yaml_that_is_a_bomb_is_refused_at_once(tmp_path: Path) -> None:
    """Files a run reads after the spec (a stage's metrics, prefect.yaml) are read with the same bounds."""
    from conveyor.errors import DeployError
    from conveyor.prefect.deploy import read_prefect_yaml
    from conveyor.run.metrics import read_metrics

    (tmp_path / "metrics.yaml").write_text(laughs() + "auc: 0.9\n")
    (tmp_path / "prefect.yaml").write_text(laughs() + "deployments: []\n")
    t0 = time.monotonic()
    assert read_metrics(tmp_path / "metrics.yaml") == {}  # unreadable metrics: none, as for a missing file
    with pytest.raises(DeployError, match="aliases expand the document"):
        read_prefect_yaml(tmp_path)
    assert time.monotonic() - t0 < 5


def test_a_bomb_in_another_dvc_file_of_the_repository_is_refused_naming_it(dvc_repo: Path) -> None:
    """conveyor reads the repository's every DVC file (as `dvc repro` builds its graph): each is
    checked as the dvc.yaml run is, before DVC parses it."""
    (dvc_repo / DVC).write_text("stages:\n  t:\n    cmd: echo hi > out.txt\n    outs: [out.txt]\n")
    (dvc_repo / "sub").mkdir()
    (dvc_repo / "sub" / DVC).write_text(laughs() + "stages:\n  u:\n    cmd: echo hi\n")
    err, wall = timed(lambda: load_project(dvc_repo / DVC))
    assert isinstance(err, SpecError) and str(dvc_repo / "sub" / DVC) in str(err), err
    assert "aliases expand the document" in str(err)
    assert wall < WALL_S, f"{wall:.2f}s"


def test_a_dvc_yaml_past_a_specs_50000_values_is_a_pipeline_not_a_bomb(dvc_repo: Path) -> None:
    """A DVC file is read with DVC-sized bounds (a 5,000-stage dvc.yaml holds about 50,000
    values): two stages of 26,000 values each load as DVC loads them (the bombs above still may
    add only 50,000 values by aliases)."""
    meta = "[" + ", ".join(f"v{k}" for k in range(26_000)) + "]"
    (dvc_repo / DVC).write_text("stages:\n" + "".join(
        f"  s{i}:\n    cmd: echo {i} > d/{i}.txt\n    deps: [{f'd/{i - 1}.txt' if i else 'in.txt'}]\n"
        f"    outs: [d/{i}.txt]\n    meta: {meta}\n" for i in range(2)))
    loaded = load_project(dvc_repo / DVC)
    assert len(loaded.pipeline.stages) == 2 and loaded.graph["s1"] == frozenset({"s0"})


def test_a_stage_name_too_long_for_the_files_a_run_names_after_it_is_a_spec_error(tmp_path: Path) -> None:
    """A run names a stage's log file and journal entry after it (NAME_MAX is 255 bytes): caught
    by validate, not by the run that would fail writing the log. A matrix item's name counts too."""
    long_name = "a" * 241
    path = tmp_path / "configs/pipeline.yaml"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(f"""
        pipeline: names
        stages:
          {long_name}: {{cmd: echo hi > out.txt, outs: [out.txt]}}
          fits: {{cmd: echo ok > ok.txt, outs: [ok.txt]}}
          sweep:
            matrix: {{v: ["{"b" * 240}", "short"]}}
            cmd: echo ${{item.v}}
        """).lstrip("\n"))
    with pytest.raises(SpecError, match="too long") as info:
        load_project(path)
    err = info.value
    [issue] = [i for i in err.issues if i.key == f"stages.{long_name}"]
    assert issue.line == 3
    assert "a stage name of 241 bytes is too long: a run names the stage's log file and journal entry after it, " \
           "which leaves at most 240 bytes" in issue.message
    item = [i for i in err.issues if i.key == "stages.sweep"]
    assert len(item) == 1 and "shorten the matrix's values or its name" in item[0].message
    assert not [i for i in err.issues if "fits" in i.key or "short" in i.key]
