"""The spec reference's key tables, generated from the spec's JSON Schema (`conveyor schema`).

``python docs/gen_spec_keys.py`` rewrites the block between the markers of
`docs/reference/spec.md`; `tests/test_docs.py` checks that the committed block is what this
prints, so a key added to the models without running it fails the tests. Types and
defaults come from the models; a description from the model where it has one, else from
``WORDS`` below (what the rest of the spec page says about the key, in a line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPEC_PAGE = Path(__file__).parent / "reference" / "spec.md"
START, END = "<!-- spec-keys:start -->", "<!-- spec-keys:end -->"

# (schema model, heading, an example line) in the order the page shows them
MODELS = [
    ("Pipeline", "The spec file", "pipeline: breast-cancer"),
    ("Stage", "A stage (`stages.NAME`)", "train: {task: tasks.train:fit, deps: [data/f], outs: [models/m.json]}"),
    ("Declared", "A declared path's options (`outs`, `metrics`)", "outs: [{models/checkpoints: {persist: true}}]"),
    ("ThreadsProfile", "A `threads` profile", "io: {kind: threads, max_workers: 16}"),
    ("DaskProfile", "A `dask` profile", "cpu: {kind: dask, n_workers: 2, memory_limit: 4GiB}"),
    ("TlsFiles", "A `dask` profile's `security`", "security: {ca_file: ca.pem, cert: c.pem, key: c-key.pem}"),
    ("DaskCudaProfile", "A `dask-cuda` profile", "gpu: {kind: dask-cuda, fallback: cpu}"),
    ("SlurmProfile", "A `slurm` profile", "hpc: {kind: slurm, queue: gpu, cores: 8, memory: 32GiB, jobs: 4}"),
    ("ModelSpec", "The `model` section", "model: {files: {xgb: models/xgb.json}, predict: tasks.predict:score}"),
    ("DvcPipeline", "A spec over an existing dvc.yaml (`dvc:`)", "dvc: dvc.yaml"),
    ("Placement", "A placement entry (`placement.GLOB`)", '"train@*": {on: gpu, retries: 1}'),
]

WORDS = {
    "pipeline": "The pipeline's name; also the Prefect flow run's.",
    "params": "Dotted keys of the params file the stage reads: a change reruns it.",
    "Pipeline.params": "The params file `${...}` and `params:` read.",
    "task_packages": "The packages a stage's `task` must live in.",
    "profiles": "Where stages run: a name per profile, a stage names one with `on:`.",
    "stages": "The stages, by name.",
    "model": "What `conveyor predict` and `serve-model` score with (see Predict and serve).",
    "task": "A `module:function` in `task_packages`, called as `fn(ctx)`; exactly one of `task` and `cmd`.",
    "cmd": "A shell command (or a list run one after another), as in dvc.yaml; `${key}` from the params file.",
    "wdir": "The directory a `cmd` runs in, relative to the project root.",
    "on": "The profile the stage runs on; omitted: the runner's own process.",
    "needs": "Stages that come before this one besides those its deps imply (a model dependency).",
    "retries": "How many times a failed stage runs again, its previous outs put back first.",
    "retry_delay_s": "Seconds between a failure and its retry.",
    "timeout_s": "Seconds after which the stage is stopped and fails.",
    "deterministic": "Pin what decides the bytes (kernel paths, threads), for the same outs on any x86-64 CPU.",
    "resources": "Dask worker resources the stage holds while it runs (`{GPU: 1}`).",
    "DaskProfile.resources": "Each worker's resources, as `dask worker --resources` (`{GPU: 1}`).",
    "SlurmProfile.resources": "Each job's workers' resources, as `dask worker --resources` (`{GPU: 1}`, "
                              "with `job_extra: [--gres=gpu:1]`).",
    "desc": "A description, as in dvc.yaml.",
    "path": "The path (the mapping's key, as written).",
    "name": "The name a task finds it by (`ctx.dep(name)`).",
    "persist": "Keep the out in place while the stage runs (as DVC's `persist`); still put back if it fails.",
    "kind": "Which executor: `threads`, `dask`, `dask-cuda` or `slurm`.",
    "max_workers": "Threads in the pool: transfers at once.",
    "address": "An existing scheduler to connect to (`tcp://host:8786`); conveyor never stops it.",
    "security": "TLS files for a `tls://` scheduler.",
    "n_workers": "Worker processes of the LocalCluster.",
    "threads_per_worker": "Threads of each worker.",
    "memory_limit": "Memory of each worker (`4GiB`); Dask pauses, spills and restarts workers past it.",
    "local_directory": "Where workers spill to disk.",
    "processes": "Workers as processes (else threads of one process).",
    "SlurmProfile.processes": "Dask worker processes per job.",
    "in_process_below": "A stage whose deps hold fewer bytes than this runs in conveyor's process, no worker started.",
    "worker_env": "Variables set before each worker process starts; `null` removes one of Dask's.",
    "no_workers_timeout_s": "A running stage fails after this long with no worker (`null` waits).",
    "ca_file": "The certificate authority's file.",
    "cert": "The client's certificate.",
    "key": "The client's private key.",
    "devices": "The GPUs to use (ids); default every visible one.",
    "rmm_pool_size": "The RMM memory pool of each GPU worker (`24GB`).",
    "protocol": "The comms protocol (`tcp`, `ucx`).",
    "fallback": "Without a GPU: `error` stops the run, `cpu` (or a profile's name) runs the stages there.",
    "queue": "The Slurm partition.",
    "account": "The Slurm account jobs are charged to.",
    "interface": "The network interface the workers listen on.",
    "cores": "Cores per job.",
    "memory": "Memory per job.",
    "walltime": "Each job's time limit (`02:00:00`).",
    "jobs": "How many batch jobs of workers to submit.",
    "job_extra": "Extra `#SBATCH` directives (`--gres=gpu:1`).",
    "files": "The outs that make up the model, by name; its version is their hash.",
    "features": "The raw columns a row must have, in order: a list, or `FILE:KEY`.",
    "predict": "`module:function` called as `predict(model, rows)`, one score per row.",
    "load": "`module:function` called as `load(files)`, once per model version.",
    "id": "The input column copied beside each score.",
    "registry": "The champion/challenger registry file.",
    "dvc": "The dvc.yaml whose stages run, untouched.",
    "placement": "Stage-name globs to where and how they run; every glob that matches applies, later ones win.",
}


# keys whose schema spells out every written form: said in words
TYPES = {"deps": "list or mapping of paths", "outs": "list or mapping of paths", "metrics": "list or mapping of paths",
         "matrix": "mapping of lists (or `${key}`)"}


def _type(prop: dict[str, Any]) -> str:
    """A JSON Schema type in a few words: `string`, `integer > 0`, `list of string`, `Declared`."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(_type(p) for p in prop["anyOf"]))
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"mapping of {_type(values)}" if isinstance(values, dict) else "mapping"
    if "exclusiveMinimum" in prop:
        return f"{kind} > {prop['exclusiveMinimum']}"
    if "minimum" in prop:
        return f"{kind} ≥ {prop['minimum']}"
    return str(kind)


def _default(model: dict[str, Any], key: str, prop: dict[str, Any]) -> str:
    if key in model.get("required", []):
        return "required"
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    return "-"


def _row(name: str, model: dict[str, Any], key: str, prop: dict[str, Any]) -> str:
    words = prop.get("description") or WORDS.get(f"{name}.{key}") or WORDS.get(key, "")
    words = " ".join(words.split()).replace("|", "\\|")
    kind = TYPES.get(key) if name == "Stage" else None
    return f"| `{key}` | {(kind or _type(prop)).replace('|', chr(92) + '|')} | {_default(model, key, prop)} | {words} |"


def keys_markdown(schema: dict[str, Any]) -> str:
    """The tables: a section per model, a row per key (key, type, default, what it is)."""
    defs = schema["$defs"]
    parts = []
    for name, heading, example in MODELS:
        model = defs[name]
        rows = [_row(name, model, key, prop) for key, prop in model["properties"].items()]
        parts.append(f"### {heading}\n\n`{example}`\n\n| key | type | default | what it is |\n"
                     f"|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def block(schema: dict[str, Any]) -> str:
    """What goes between the markers (`conveyor schema` names the models' keys)."""
    return f"{START}\n\n{keys_markdown(schema)}\n{END}"


if __name__ == "__main__":
    from conveyor.spec.schema import spec_schema

    text = SPEC_PAGE.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    SPEC_PAGE.write_text(head + block(spec_schema()) + tail)
    sys.stdout.write(f"wrote the key tables of {SPEC_PAGE}\n")
