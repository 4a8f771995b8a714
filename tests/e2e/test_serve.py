"""`conveyor serve-model` as a user starts it: a real uvicorn server on a free loopback port,
called over HTTP. The reference pipeline's model (trained here once for the module) scores rows
exactly as its evaluate stage did; bad payloads are 422 naming the field, oversized ones 413;
schemathesis finds no server error in the served OpenAPI; on the linear project, a champion
promoted in the middle of 20 threads of requests is taken over without a failed request.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
from projects import LINEAR_FEATURES, FirstRun, Project, evaluated_test_rows, linear_model, linear_scores

from conveyor.models import registry as reg
from conveyor.predict.model import version_of
from tasks.preprocess import load_stats


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def served(project: Project, *args: str) -> Iterator[Service]:
    """``conveyor serve-model --port 0 ARGS`` until the block ends, then Ctrl-C; its output is
    drained meanwhile (access logs would fill the pipe and stall the server)."""
    proc = project.popen("serve-model", "--port", "0", *args)
    service = Service("", proc)
    ready = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            service.lines.append(line)
            if line.startswith("serving model ") and not service.url:
                service.url = line.split(" at ", 1)[1].split()[0]
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(120) and service.url, service.log
        yield service
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            proc.kill()


@pytest.fixture(scope="module")
def reference_service(first_run: FirstRun, tmp_path_factory: pytest.TempPathFactory,
                      prefect_server: dict[str, str]) -> Iterator[tuple[Project, Service]]:
    """The reference pipeline as its first run left it, its model served with small limits (600 rows, 1 MiB)."""
    project = first_run.copy(tmp_path_factory.mktemp("served") / "clone", prefect_server)
    with served(project, "--max-rows", "600", "--max-body", "1MiB") as service:
        yield project, service
    assert service.proc.returncode == 130, service.log
    assert "interrupted (SIGINT): the model service stopped" in service.log
    assert "POST /predict" not in service.log  # no access line per request unless --log-level info
    assert not project.left_running()


@pytest.mark.slow
def test_the_service_scores_rows_as_the_evaluate_stage_did(reference_service: tuple[Project, Service]) -> None:
    project, service = reference_service
    raw = pd.read_parquet(project.root / "data/raw").drop(columns="target")
    answer = httpx.post(f"{service.url}/predict", json={"rows": raw.to_dict(orient="records")}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    card = httpx.get(f"{service.url}/model").json()
    assert body["model"] == card["version"] == httpx.get(f"{service.url}/health").json()["model"]
    assert card["source"] == "latest run" and "no champion has been promoted yet" in card["note"]
    processed = project.root / "data/processed"
    stats = load_stats(processed)
    assert card["features"] == stats["features"] and card["files"]["xgb"] == "models/xgb.json"
    assert set(card["metrics"]) >= {"evaluate:stack.auc", "evaluate:mlp.auc"}

    ids, evaluated = evaluated_test_rows(project.root, raw)
    assert np.asarray(body["scores"])[ids].tolist() == evaluated

    openapi = httpx.get(f"{service.url}/openapi.json").json()
    row = openapi["components"]["schemas"]["Row"]
    assert list(row["properties"]) == stats["features"] and row["additionalProperties"] is False


@pytest.mark.slow
def test_bad_payloads_are_4xx_naming_the_field(reference_service: tuple[Project, Service]) -> None:
    project, service = reference_service
    raw = pd.read_parquet(project.root / "data/raw").drop(columns="target")
    rows = raw.head(3).to_dict(orient="records")

    def post(payload: object) -> httpx.Response:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return httpx.post(f"{service.url}/predict", content=content, headers={"Content-Type": "application/json"},
                          timeout=60)

    def problems(answer: httpx.Response) -> list[tuple[tuple[object, ...], str]]:
        assert answer.status_code == 422, answer.text
        return [(tuple(d["loc"]), d["type"]) for d in answer.json()["detail"]]

    missing = [rows[0], {k: v for k, v in rows[1].items() if k != "mean_radius"}]
    assert problems(post({"rows": missing})) == [(("body", "rows", 1, "mean_radius"), "missing")]
    assert problems(post({"rows": [{**rows[0], "target": 1}]})) == [(("body", "rows", 0, "target"),
                                                                       "extra_forbidden")]
    assert problems(post({"rows": [{**rows[0], "worst_area": "big"}]})) == [(("body", "rows", 0, "worst_area"),
                                                                              "float_parsing")]
    assert problems(post({"rows": []})) == [(("body", "rows"), "too_short")]
    assert problems(post({"row": rows})) == [(("body", "rows"), "missing"), (("body", "row"), "extra_forbidden")]
    assert problems(post(b'{"rows": [NaN]')) == [(("body",), "json_invalid")]

    too_many = post({"rows": rows * 201})  # 603 rows, under 1 MiB
    assert too_many.status_code == 413 and "more than 600 rows" in too_many.json()["detail"]
    too_big = post({"rows": [{**rows[0], "pad": "x" * 2**20}]})
    assert too_big.status_code == 413 and "at most 1,048,576" in too_big.json()["detail"]
    assert httpx.post(f"{service.url}/predict", json={"rows": rows}).status_code == 200


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(reference_service: tuple[Project, Service], tmp_path: Path) -> None:
    _, service = reference_service
    fuzzed = subprocess.run(
        ["schemathesis", "run", f"{service.url}/openapi.json", "--checks",
         "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         "--max-examples", "60", "--seed", "7", "--no-color", "--generation-database", "none"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert fuzzed.returncode == 0, fuzzed.stdout[-4000:] + fuzzed.stderr[-2000:]
    assert "No issues found" in fuzzed.stdout
    assert "500 Internal Server Error" not in service.log


def _promote(root: Path, run_id: str, bias: float | str) -> str:
    """Make a champion of the linear model with ``bias`` (a string: a file that does not load)."""
    rel = f"models/champions/{run_id}/models/linear.json"
    (root / rel).parent.mkdir(parents=True)
    (root / rel).write_text(linear_model(bias) if isinstance(bias, float) else bias)
    version = version_of({"weights": root / rel})
    path = root / "models/registry.json"
    with reg.locked(path):
        book = reg.load(path).add(reg.Candidate(
            run_id=run_id, time=datetime.now(UTC).isoformat(), status="promoted", reason="test",
            metric="metrics/m.json:score", value=1.0, files={"weights": rel}, version=version))
        reg.save(path, book)
    return version


def test_a_champion_promoted_under_load_is_taken_over_without_a_failed_request(linear_project: Project) -> None:
    root = linear_project.root
    (root / "models/linear.json").write_text(linear_model(9.0))  # the latest run's: not served while a champion is
    first = _promote(root, "r1", 0.5)
    rng = np.random.default_rng(3)
    with served(linear_project) as service, httpx.Client(base_url=service.url, timeout=30) as client:
        card = client.get("/model").json()
        assert (card["version"], card["source"], card["run_id"]) == (first, "champion", "r1")
        assert card["features"] == LINEAR_FEATURES
        assert card["files"] == {"weights": "models/champions/r1/models/linear.json"}

        answers: list[tuple[int, str, bool]] = []
        lock = threading.Lock()
        swapped = threading.Event()
        second_seen = threading.Event()
        second = ""

        def caller(seed: int) -> None:
            local = np.random.default_rng(seed)
            done = 0
            while done < 10 or (not second_seen.wait(0) and done < 2000):
                frame = pd.DataFrame(local.standard_normal((5, len(LINEAR_FEATURES))), columns=LINEAR_FEATURES)
                answer = client.post("/predict", json={"rows": frame.to_dict(orient="records")})
                ok = answer.status_code == 200
                model = answer.json()["model"] if ok else answer.text
                if ok:
                    bias = {first: 0.5}.get(model, 1.5)
                    ok = np.allclose(answer.json()["scores"], linear_scores(frame, bias), rtol=0, atol=1e-12)
                with lock:
                    answers.append((answer.status_code, model, ok))
                    if len(answers) == 50:
                        swapped.set()
                if swapped.is_set() and model == second:
                    second_seen.set()
                done += 1

        with ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(caller, int(rng.integers(1 << 30))) for _ in range(20)]
            assert swapped.wait(60)
            second = _promote(root, "r2", 1.5)
            for future in futures:
                future.result()
        assert len(answers) >= 200
        assert all(status == 200 and ok for status, _, ok in answers), [a for a in answers if not a[2]][:3]
        assert {model for _, model, _ in answers} == {first, second}
        assert client.get("/model").json()["run_id"] == "r2"

        # a champion that does not load: the service keeps the one it has, and says so
        _promote(root, "r3", "{not json")
        for _ in range(100):
            if "could not be loaded" in service.log:
                break
            threading.Event().wait(0.1)
        assert "kept model " + second in service.log
        assert client.post("/predict", json={"rows": [dict.fromkeys(LINEAR_FEATURES, 0.0)]}).json() == {
            "scores": [1.5], "model": second}
    assert service.proc.returncode == 130
    assert "interrupted (SIGINT): the model service stopped" in service.log
    assert not linear_project.left_running()


def test_serve_model_refuses_what_it_cannot_serve(linear_project: Project) -> None:
    (linear_project.root / "models/linear.json").unlink()
    missing = linear_project.conveyor("serve-model", "--port", "0")
    assert missing.returncode == 1, missing.stderr
    assert "model (latest run) is missing weights (models/linear.json): run the pipeline first" in missing.stderr
    assert "Traceback" not in missing.stderr
    linear_project.write("models/linear.json", linear_model())
    for args, message in [(("--max-body", "lots"), "--max-body lots: write a size like 16MiB"),
                          (("--model", "nowhere"), "--model nowhere: not a directory"),
                          (("--host", "192.0.2.1"), "--host 192.0.2.1 --port 0: cannot listen there"),
                          (("--log-level", "loud"), "--log-level loud: one of critical, error, warning, info")]:
        refused = linear_project.conveyor("serve-model", "--port", "0", *args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
    linear_project.write("configs/pipeline.yaml", "pipeline: x\nstages:\n  a: {cmd: 'true'}\n")
    bare = linear_project.conveyor("serve-model")
    assert bare.returncode == 2 and "declares no model: add a 'model:' section" in bare.stderr
    (linear_project.root / "configs/pipeline.yaml").unlink()  # a DVC project: its dvc.yaml can hold no model
    linear_project.init_dvc()
    linear_project.write("dvc.yaml", "stages:\n  a: {cmd: 'true'}\n")
    for command in ("serve-model", "predict"):
        args = ["-i", "rows.parquet", "-o", "out.parquet"] if command == "predict" else []
        dvc = linear_project.conveyor(command, *args)
        assert dvc.returncode == 2 and "dvc.yaml cannot declare a model: write a small conveyor spec beside it" \
            in dvc.stderr, dvc.stderr
