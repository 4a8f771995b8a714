"""The spec's JSON Schema (`conveyor schema`): every spec the loader accepts validates against it,
and a misspelt key is flagged where it is, as an editor shows it while the user types."""

from __future__ import annotations

import ast
import json
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conveyor.errors import SpecError
from conveyor.spec.matrix import expand
from conveyor.spec.parse import parse_dvc_pipeline, parse_pipeline
from conveyor.spec.schema import SCHEMA_FILE, spec_schema
from conveyor.spec.yamlmap import load_yaml

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_SPEC = REPO / "src/conveyor/scaffold/template/configs/pipeline.yaml"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = spec_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(validator: jsonschema.Draft202012Validator, data: Any) -> list[tuple[str, str]]:
    """(key path, message) of each error, as an editor underlines them: of an ``anyOf`` (a value
    that may also be null), the error of the branch that came closest (deepest, not a mere type)."""
    found = []
    for error in validator.iter_errors(data):
        while error.context:
            error = max(error.context, key=lambda e: (len(e.absolute_path), e.validator != "type"))
        found.append((".".join(map(str, error.absolute_path)), error.message))
    return sorted(found)


def written(text: str, tmp_path: Path) -> Any:
    """A spec read as conveyor reads it (YAML 1.2: `on:` is a key, not True), before any check."""
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return load_yaml(path).data


@pytest.mark.parametrize("spec", [*sorted((REPO / "configs").glob("*.yaml")), TEMPLATE_SPEC],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_the_repositorys_specs_and_the_init_template_validate(
        validator: jsonschema.Draft202012Validator, spec: Path) -> None:
    assert problems(validator, load_yaml(spec).data) == []


def test_the_init_template_points_editors_at_the_schema_file() -> None:
    first = TEMPLATE_SPEC.read_text(encoding="utf-8").splitlines()[0]
    assert first == f"# yaml-language-server: $schema=../{SCHEMA_FILE}"  # relative to configs/


def accepted_test_specs(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """The spec texts of this test suite (string literals) that conveyor's models accept."""
    path = tmp_path / "spec.yaml"
    for module in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and ("stages:" in node.value or "dvc:" in node.value)):
                continue
            path.write_text(textwrap.dedent(node.value).lstrip(), encoding="utf-8")
            try:
                doc = load_yaml(path)
                if not isinstance(doc.data, dict):
                    continue
                if "dvc" in doc.data:
                    parse_dvc_pipeline(doc)
                else:
                    made = expand(doc, {})
                    if made.issues:  # a matrix from a params file this test has not
                        continue
                    parse_pipeline(made.doc, made.items)
            except (yaml.YAMLError, SpecError):
                continue
            yield f"{module.relative_to(REPO)}:{node.lineno}", doc.data


def test_every_spec_the_tests_use_that_conveyor_accepts_validates(
        validator: jsonschema.Draft202012Validator, tmp_path: Path) -> None:
    specs = list(accepted_test_specs(tmp_path))
    assert len(specs) > 40  # the suite's specs were found: every form of deps, outs, matrix, placement
    assert {where: problems(validator, data) for where, data in specs if problems(validator, data)} == {}


def test_the_written_forms_interpolations_and_matrices_validate(
        validator: jsonschema.Draft202012Validator, tmp_path: Path) -> None:
    spec = written("""
        pipeline: forms
        profiles:
          cpu: {kind: dask, address: "tcp://127.0.0.1:8786", no_workers_timeout_s: null}
        stages:
          train:
            matrix: {eta: "${sweep.etas}", depth: [6, 8], model: [{kind: a}, {kind: b}]}
            cmd: ["python train.py --eta ${item.eta}", "echo ${item.depth}"]
            on: cpu
            deps: {data: data/processed, code: train.py}
            outs:
              - models/m-${item.eta}.json
              - models/ckpt: {persist: true}
              - models/cache:
            metrics: {scores: {path: "metrics/${key}.json", persist: false}}
            retries: 2
            retry_delay_s: 0.5
          report: {task: "tasks.report:write", needs: [train], deps: [models], outs: [report.md]}
    """, tmp_path)
    assert problems(validator, spec) == []
    placement = written("""
        dvc: dvc.yaml
        profiles: {gpu: {kind: dask-cuda, fallback: cpu}}
        placement:
          "train@*": {on: gpu, retries: 1, timeout_s: 600, deterministic: true}
    """, tmp_path)
    assert problems(validator, placement) == []


@pytest.mark.parametrize(("spec", "expected"), [
    ("pipeline: p\nstages:\n  a: {task: 't:f', dep: [x]}\n",
     ("stages.a", "Additional properties are not allowed ('dep' was unexpected)")),
    ("pipeline: p\nstage:\n  a: {task: 't:f'}\nstages:\n  a: {task: 't:f'}\n",
     ("", "Additional properties are not allowed ('stage' was unexpected)")),
    ("pipeline: p\nprofiles:\n  cpu: {kind: dask, n_worker: 2}\nstages:\n  a: {task: 't:f', on: cpu}\n",
     ("profiles.cpu", "Additional properties are not allowed ('n_worker' was unexpected)")),
    ("pipeline: p\nprofiles:\n  gpu: {kind: dask-cud}\nstages:\n  a: {task: 't:f'}\n",
     ("profiles.gpu.kind", "'dask-cud' is not one of ['threads', 'dask', 'dask-cuda', 'slurm']")),
    ("pipeline: p\nstages:\n  a: {task: 't:f', outs: [{m.pt: {persit: true}}]}\n",
     ("stages.a.outs", "")),
    ("dvc: dvc.yaml\nplacment:\n  train: {on: gpu}\n",
     ("", "Additional properties are not allowed ('placment' was unexpected)")),
    ("dvc: dvc.yaml\nplacement:\n  train: {onn: gpu}\n",
     ("placement.train", "Additional properties are not allowed ('onn' was unexpected)")),
    ("pipeline: p\nstages:\n  a: {task: 't:f'}\n"
     "model: {files: {m: m.json}, features: [x], predict: 't:p', lod: 't:l'}\n",
     ("model", "Additional properties are not allowed ('lod' was unexpected)")),
], ids=["stage-key", "top-level-key", "profile-key", "profile-kind", "out-option", "placement-top",
        "placement-key", "model-key"])
def test_a_misspelt_key_is_flagged_where_it_is(
        validator: jsonschema.Draft202012Validator, tmp_path: Path, spec: str, expected: tuple[str, str]) -> None:
    found = problems(validator, written(spec, tmp_path))
    key, message = expected
    assert any(where.startswith(key) and message in said for where, said in found), found
    with pytest.raises(SpecError, match=r"unknown (profile kind|key)"):  # the loader refuses it too
        doc = load_yaml(tmp_path / "spec.yaml")
        parse_dvc_pipeline(doc) if "dvc" in doc.data else parse_pipeline(doc)


def test_the_schema_describes_each_part_in_the_models_words(validator: jsonschema.Draft202012Validator) -> None:
    schema = validator.schema
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema" and schema["title"]
    defs = schema["$defs"]
    assert defs["Stage"]["description"].startswith("One step of the pipeline: a task or a command")
    assert defs["DvcPipeline"]["description"] == ("A spec that runs an existing dvc.yaml as it is, adding only "
                                                  "where its stages run.")
    closed = [name for name, body in defs.items() if body.get("properties") and name != "Profile"]
    assert all(defs[name]["additionalProperties"] is False for name in closed), closed


def test_conveyor_schema_prints_it(tmp_path: Path) -> None:
    done = subprocess.run(["conveyor", "schema"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    assert json.loads(done.stdout) == spec_schema()
