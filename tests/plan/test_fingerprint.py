"""When is a stage up to date: deps, params, code and outs against the dvc.lock-like record.

The project (drawn below) lives in ``tmp_path``; a "run" of a stage is simulated by writing
its outs and saving its current state, as the runner does after a success.

    ingest ──► prepare ──► train          other (its own branch)
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from conveyor.plan.fingerprint import (
    FingerprintRecord,
    Hasher,
    LockRecord,
    current_state,
    plan,
    stale_reasons,
)
from conveyor.spec.project import Project, load_project

if TYPE_CHECKING:
    from conftest import ProjectDir

SPEC = """
pipeline: fp
stages:
  ingest:
    task: tasks.ingest:fetch
    params: [ingest]
    outs: [data/raw]
  prepare:
    task: tasks.prepare:prepare
    deps: [data/raw]
    params: [preprocess]
    outs: [data/processed.csv]
  train:
    task: tasks.train:train
    deps: [data/processed.csv]
    params: [train.xgb]
    outs: [models/xgb.json]
    metrics: [metrics/train.json]
  other:
    task: tasks.ingest:other
    outs: [data/other.txt]
"""

MODULES = {
    "tasks/ingest.py": "def fetch(ctx):\n    return None\n\n\ndef other(ctx):\n    return None\n",
    "tasks/prepare.py": "from tasks.helpers import scale\n\n\ndef prepare(ctx):\n    return scale(1)\n",
    "tasks/train.py": "from tasks import helpers\n\n\ndef train(ctx):\n    return helpers.scale(2)\n",
}

OUTS = {
    "ingest": {"data/raw/part-0.csv": "a,b\n1,2\n", "data/raw/part-1.csv": "a,b\n3,4\n"},
    "prepare": {"data/processed.csv": "a,b\n1,2\n3,4\n"},
    "train": {"models/xgb.json": '{"trees": 3}', "metrics/train.json": '{"auc": 0.9}'},
    "other": {"data/other.txt": "other\n"},
}


@pytest.fixture
def fp(project: ProjectDir) -> ProjectDir:
    for rel, text in MODULES.items():
        project.write(rel, text)
    project.spec(SPEC)
    return project


def load(project: ProjectDir) -> Project:
    return load_project(project.root / "configs" / "pipeline.yaml")


def succeed(project: ProjectDir, *stages: str) -> Project:
    """Write the outs of ``stages`` and record each as a success, in order."""
    loaded = load(project)
    record = LockRecord.for_project(loaded)
    for stage in stages:
        for rel, text in OUTS[stage].items():
            project.write(rel, text)
        record.save(stage, current_state(loaded, stage, Hasher()), "params.yaml")
    return loaded


def reasons(project: ProjectDir, stage: str) -> list[str]:
    """Why ``stage`` is stale now, with a fresh project (params re-read) and a fresh hasher."""
    loaded = load(project)
    recorded = LockRecord.for_project(loaded).stages().get(stage)
    return stale_reasons(loaded, stage, current_state(loaded, stage, Hasher()), recorded)


def all_ran(project: ProjectDir) -> Project:
    return succeed(project, "ingest", "prepare", "train", "other")


# --- never run, up to date ----------------------------------------------------------------


def test_a_stage_never_run_is_stale(fp: ProjectDir) -> None:
    loaded = load(fp)
    assert stale_reasons(loaded, "ingest", current_state(loaded, "ingest", Hasher()), None) == ["never run"]
    assert plan(loaded, set(loaded.order), FingerprintRecord(loaded)) == {
        "ingest": ["never run"],
        "other": ["never run"],
        "prepare": ["never run", "upstream 'ingest' is stale"],
        "train": ["never run", "upstream 'prepare' is stale"],
    }


def test_nothing_changed_means_up_to_date(fp: ProjectDir) -> None:
    loaded = all_ran(fp)
    everything = plan(loaded, set(loaded.order), FingerprintRecord(loaded))
    assert everything == {"ingest": [], "prepare": [], "train": [], "other": []}


def test_current_state_holds_deps_code_params_and_outs(fp: ProjectDir) -> None:
    loaded = all_ran(fp)
    state = current_state(loaded, "train", Hasher())
    assert state.cmd == "conveyor exec train"
    assert [e.path for e in state.deps] == [
        "data/processed.csv", "tasks/__init__.py", "tasks/helpers.py", "tasks/train.py"]
    assert state.params == {"train.xgb": {"max_depth": 3, "eta": 0.1}}
    assert [e.path for e in state.outs] == ["models/xgb.json", "metrics/train.json"]
    assert [e.path for e in current_state(loaded, "prepare", Hasher()).deps] == [
        "data/raw", "tasks/helpers.py", "tasks/prepare.py"]


# --- deps ---------------------------------------------------------------------------------


def test_a_changed_dep_file(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("data/processed.csv", "a,b\n9,9\n")
    assert reasons(fp, "train") == ["dep changed: data/processed.csv"]
    assert reasons(fp, "prepare") == ["out changed: data/processed.csv"]


def test_a_changed_file_in_a_dep_directory(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("data/raw/part-1.csv", "a,b\n3,5\n")
    assert reasons(fp, "prepare") == ["dep changed: data/raw"]
    assert reasons(fp, "ingest") == ["out changed: data/raw"]


def test_a_new_file_in_a_dep_directory(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("data/raw/nested/part-2.csv", "a,b\n5,6\n")
    assert reasons(fp, "prepare") == ["dep changed: data/raw"]


def test_a_renamed_file_in_a_dep_directory(fp: ProjectDir) -> None:
    all_ran(fp)
    (fp.root / "data/raw/part-1.csv").rename(fp.root / "data/raw/part-9.csv")
    assert reasons(fp, "prepare") == ["dep changed: data/raw"]


def test_a_missing_dep(fp: ProjectDir) -> None:
    all_ran(fp)
    (fp.root / "data/processed.csv").unlink()
    assert reasons(fp, "train") == ["dep missing: data/processed.csv"]


def test_touching_a_dep_without_changing_it_keeps_it_up_to_date(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("data/processed.csv", OUTS["prepare"]["data/processed.csv"])
    assert reasons(fp, "train") == []


# --- params -------------------------------------------------------------------------------


def test_a_changed_param_names_the_leaf_key(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("params.yaml", (fp.root / "params.yaml").read_text().replace("max_depth: 3", "max_depth: 6"))
    assert reasons(fp, "train") == ["params changed: train.xgb.max_depth 3 → 6"]
    assert reasons(fp, "prepare") == []


def test_an_added_and_a_removed_param_are_named(fp: ProjectDir) -> None:
    all_ran(fp)
    text = (fp.root / "params.yaml").read_text()
    fp.write("params.yaml", text.replace("    eta: 0.1\n", "    subsample: 0.8\n"))
    assert reasons(fp, "train") == ["params changed: train.xgb.subsample (unset) → 0.8",
                                     "params changed: train.xgb.eta 0.1 → (unset)"]


def test_a_param_of_another_stage_does_not_matter(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("params.yaml", (fp.root / "params.yaml").read_text().replace("hidden: 16", "hidden: 32"))
    loaded = load(fp)
    everything = plan(loaded, set(loaded.order), FingerprintRecord(loaded))
    assert everything == {"ingest": [], "prepare": [], "train": [], "other": []}


# --- code ---------------------------------------------------------------------------------


def test_a_changed_task_module(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("tasks/prepare.py", MODULES["tasks/prepare.py"] + "\n# tuned\n")
    assert reasons(fp, "prepare") == ["code changed: tasks/prepare.py"]
    assert reasons(fp, "train") == []


def test_a_changed_module_the_task_imports(fp: ProjectDir) -> None:
    """prepare does ``from tasks.helpers import scale``, train ``from tasks import helpers``."""
    all_ran(fp)
    fp.write("tasks/helpers.py", "def scale(x):\n    return x * 3\n")
    assert reasons(fp, "prepare") == ["code changed: tasks/helpers.py"]
    assert reasons(fp, "train") == ["code changed: tasks/helpers.py"]
    assert reasons(fp, "ingest") == []


def test_an_unrelated_module_does_not_matter(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("tasks/unrelated.py", "def unused():\n    return 1\n")
    fp.write("tasks/brand_new.py", "X = 1\n")
    loaded = load(fp)
    everything = plan(loaded, set(loaded.order), FingerprintRecord(loaded))
    assert everything == {"ingest": [], "prepare": [], "train": [], "other": []}


def test_a_changed_module_imported_relatively(fp: ProjectDir) -> None:
    fp.write("tasks/ingest.py", "from .helpers import scale\n\n\ndef fetch(ctx):\n    return scale(1)\n\n\n"
                                "def other(ctx):\n    return None\n")
    all_ran(fp)
    fp.write("tasks/helpers.py", "def scale(x):\n    return x * 3\n")
    assert reasons(fp, "ingest") == ["code changed: tasks/helpers.py"]


def test_finding_the_code_of_a_task_imports_nothing(project: ProjectDir, monkeypatch: pytest.MonkeyPatch,
                                                    forget_packages: set[str]) -> None:
    """With the root importable (as during a run), ``task_sources`` must still only read files."""
    forget_packages.add("fpsteps")
    project.write("fpsteps/__init__.py", "")
    project.write("fpsteps/heavy.py", "import sys\nsys.modules[__name__].IMPORTED = True\nTHING = 1\n")
    project.write("fpsteps/stage.py", "from fpsteps.heavy import THING\n\n\ndef run(ctx):\n    return THING\n")
    spec = project.spec("""
        pipeline: demo
        task_packages: [fpsteps]
        stages:
          one: {task: "fpsteps.stage:run", outs: [out.txt]}
    """)
    loaded = load_project(spec)
    monkeypatch.syspath_prepend(str(project.root))
    sources = loaded.task_sources("one")
    assert sources == [project.root / "fpsteps/heavy.py", project.root / "fpsteps/stage.py"]
    assert "fpsteps.heavy" not in sys.modules


# --- outs ---------------------------------------------------------------------------------


def test_a_missing_out(fp: ProjectDir) -> None:
    all_ran(fp)
    (fp.root / "models/xgb.json").unlink()
    assert reasons(fp, "train") == ["out missing: models/xgb.json"]


def test_a_changed_out_and_metrics_file(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("models/xgb.json", '{"trees": 4}')
    fp.write("metrics/train.json", '{"auc": 0.5}')
    assert reasons(fp, "train") == ["out changed: models/xgb.json", "out changed: metrics/train.json"]


# --- plan ---------------------------------------------------------------------------------


def test_plan_marks_everything_downstream_of_a_stale_stage(fp: ProjectDir) -> None:
    all_ran(fp)
    fp.write("params.yaml", (fp.root / "params.yaml").read_text().replace("shards: 4", "shards: 8"))
    loaded = load(fp)
    assert plan(loaded, set(loaded.order), FingerprintRecord(loaded)) == {
        "ingest": ["params changed: ingest.shards 4 → 8"],
        "prepare": ["upstream 'ingest' is stale"],
        "train": ["upstream 'prepare' is stale"],
        "other": [],
    }


def test_plan_covers_only_the_selection(fp: ProjectDir) -> None:
    """A stale stage outside the selection does not make the selected ones stale."""
    all_ran(fp)
    fp.write("tasks/ingest.py", MODULES["tasks/ingest.py"] + "\n# changed\n")
    loaded = load(fp)
    assert plan(loaded, {"prepare", "train"}, FingerprintRecord(loaded)) == {"prepare": [], "train": []}
    assert plan(loaded, {"ingest", "prepare"}, FingerprintRecord(loaded)) == {
        "ingest": ["code changed: tasks/ingest.py"], "prepare": ["upstream 'ingest' is stale"]}


def test_plan_force_reruns_the_selection(fp: ProjectDir) -> None:
    loaded = all_ran(fp)
    assert plan(loaded, {"ingest", "prepare"}, FingerprintRecord(loaded), force=True) == {
        "ingest": ["forced"], "prepare": ["forced", "upstream 'ingest' is stale"]}


# --- the record ---------------------------------------------------------------------------


def test_the_record_is_a_dvc_lock_like_file_in_json_which_is_yaml(fp: ProjectDir) -> None:
    loaded = succeed(fp, "ingest", "prepare")
    path = fp.root / ".conveyor" / "locks" / "configs__pipeline.yaml.lock"
    assert LockRecord.for_project(loaded).path == path
    text = path.read_text()
    assert text.startswith('{"schema": "2.0", "stages": {\n "ingest": ')  # a stage per line
    assert yaml.safe_load(text) == json.loads(text)
    data = yaml.safe_load(text)
    assert list(data["stages"]) == ["ingest", "prepare"]
    ingest, prepare = data["stages"]["ingest"], data["stages"]["prepare"]
    assert ingest["cmd"] == "conveyor exec ingest"
    assert ingest["params"] == {"params.yaml": {"ingest": {"shards": 4, "url": "https://example.org/data.csv"}}}
    (raw,) = ingest["outs"]
    assert set(raw) == {"path", "hash", "md5", "size", "nfiles"}
    assert (raw["path"], raw["hash"], raw["nfiles"], raw["size"]) == ("data/raw", "md5", 2, 16)
    assert raw["md5"].endswith(".dir") and len(raw["md5"]) == 32 + 4
    assert [d["path"] for d in prepare["deps"]] == ["data/raw", "tasks/helpers.py", "tasks/prepare.py"]
    assert prepare["deps"][0]["md5"] == raw["md5"]
    processed = prepare["outs"][0]
    assert set(processed) == {"path", "hash", "md5", "size"}
    assert (processed["path"], processed["size"]) == ("data/processed.csv", 12)
    assert processed["md5"] == hashlib.md5(OUTS["prepare"]["data/processed.csv"].encode()).hexdigest()



def test_a_record_written_in_yaml_by_an_earlier_version_is_still_read(fp: ProjectDir) -> None:
    loaded = succeed(fp, "ingest", "prepare")
    path = LockRecord.for_project(loaded).path
    path.write_text(yaml.safe_dump(json.loads(path.read_text()), sort_keys=False))
    assert plan(loaded, {"ingest", "prepare"}, FingerprintRecord(loaded)) == {"ingest": [], "prepare": []}

def test_the_record_is_replaced_whole_and_leaves_no_temporary_file(fp: ProjectDir) -> None:
    loaded = all_ran(fp)
    record = LockRecord.for_project(loaded)
    assert sorted(p.name for p in record.path.parent.iterdir()) == [record.path.name]
    assert set(record.stages()) == {"ingest", "prepare", "train", "other"}


def test_stages_saved_from_parallel_threads_all_land(fp: ProjectDir) -> None:
    loaded = all_ran(fp)
    record = LockRecord(fp.root / ".conveyor" / "locks" / "parallel.lock")
    state = current_state(loaded, "other", Hasher())
    threads = [threading.Thread(target=record.save, args=(f"s{i}", state, "params.yaml")) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(record.stages()) == {f"s{i}" for i in range(12)}


def test_a_stage_without_deps_or_params_records_only_what_it_has(fp: ProjectDir) -> None:
    loaded = succeed(fp, "other")
    entry = LockRecord.for_project(loaded).stages()["other"]
    assert list(entry) == ["cmd", "deps", "outs"]
    assert [d["path"] for d in entry["deps"]] == ["tasks/ingest.py"]


def test_another_spec_has_its_own_record_and_command(fp: ProjectDir) -> None:
    spec = fp.spec(SPEC, rel="configs/other.yaml")
    loaded = load_project(spec)
    assert LockRecord.for_project(loaded).path == fp.root / ".conveyor/locks/configs__other.yaml.lock"
    assert current_state(loaded, "ingest", Hasher()).cmd == "conveyor exec ingest -c configs/other.yaml"


def test_a_project_loaded_from_a_relative_spec_path(fp: ProjectDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(fp.root)
    loaded = load_project(Path("configs/pipeline.yaml"))
    assert LockRecord.for_project(loaded).path == fp.root / ".conveyor/locks/configs__pipeline.yaml.lock"
