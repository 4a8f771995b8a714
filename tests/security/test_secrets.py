"""A credential in a source URL never leaves params.yaml: not on the console, in the stage
logs, the run record, nor in Prefect's task runs, logs and artifacts.

The source is served by a local HTTP server that fails every request, so the URL ends up
in error messages, retries' warnings and Prefect's failure state: everywhere it could leak.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from httpfiles import serving
from projects import Project, prefect_api

pytestmark = pytest.mark.slow

SECRET = "S3CRET-t0ken-" + uuid.uuid4().hex[:8]


class _Failing(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(503)
        self.end_headers()

    do_GET = do_HEAD


@pytest.fixture
def failing_server() -> Iterator[str]:
    with serving(_Failing) as server:
        yield f"127.0.0.1:{server.server_address[1]}"


def prefect_texts(project: Project, flow_run_id: str, deadline_s: float = 30) -> list[str]:
    """What Prefect's server holds of a flow run: its logs, task runs' state messages, artifacts."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    run_id = uuid.UUID(flow_run_id)
    deadline = time.monotonic() + deadline_s
    with prefect_api(project.env["PREFECT_API_URL"]) as api:
        while True:  # logs and task runs reach the server a moment after the run
            logs = api.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            tasks = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            if (logs and tasks and all(t.state is not None and t.state.is_final() for t in tasks)) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        by_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        artifacts = api.read_artifacts(artifact_filter=by_run)
        texts = [log.message for log in logs]
        texts += [f"{t.state.message} {t.state.data}" for t in tasks if t.state is not None]
        texts += [str(a.data) + str(a.description) for a in artifacts]
        return texts


def test_a_credential_in_a_source_url_is_written_nowhere(
        reference_project: Project, failing_server: str, make_project: Callable[[], Project]) -> None:
    project = reference_project
    project.write("configs/pipeline.yaml", """
        pipeline: secret
        profiles:
          io: {kind: threads, max_workers: 2}
        stages:
          ingest:
            task: tasks.ingest:fetch
            on: io
            params: [ingest]
            outs: [data/raw]
    """)
    url = f"http://alice:{SECRET}@{failing_server}/data.csv"
    project.write("params.yaml", f"""
        ingest:
          sources: ["{url}"]
          format: csv
          columns: [a, b]
          retry: {{attempts: 2, initial_delay_s: 0.05, max_delay_s: 0.1}}
    """)
    result = project.conveyor("run", "-v")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"http://***@{failing_server}/data.csv" in result.stderr  # the failure still names the source
    assert SECRET not in result.stdout + result.stderr

    leaked = [p for p in project.root.rglob("*") if p.is_file() and p.name != "params.yaml"
              and SECRET in p.read_text(encoding="utf-8", errors="replace")]
    assert not leaked, f"the credential was written to {leaked}"
    record = project.record()
    assert record["stages"]["ingest"]["status"] == "failed"

    texts = prefect_texts(project, record["flow_run_id"])
    assert texts, "Prefect's server holds nothing of the run"
    assert any("***@" in text for text in texts)
    assert not [text for text in texts if SECRET in text]


def test_redaction_keeps_urls_without_credentials(tmp_path: Path) -> None:
    from conveyor.errors import redact

    assert redact("https://alice:pw@host/x.csv and https://TOKEN@host/y") == "https://***@host/x.csv and https://***@host/y"
    for kept in ("s3://bucket/key@v1", "git@github.com:org/repo", "https://host/a@b", "mailto:a@b.c"):
        assert redact(kept) == kept


def test_a_changed_param_holding_a_url_with_credentials_is_shown_masked() -> None:
    """`status` and the run record's reason show changed params; a source URL's password is not shown."""
    was = {"ingest": {"sources": ["https://analyst:hunter2@data.example.com/a.csv"]}}
    now = {"ingest": {"sources": ["https://analyst:SECRET-TOKEN@data.example.com/b.csv"]}}
    from conveyor.plan.fingerprint import param_changes

    [reason] = param_changes(was, now)
    assert "hunter2" not in reason and "SECRET" not in reason and "analyst" not in reason
    assert reason.startswith('params changed: ingest.sources ["https://***@data.example.com/a.csv"] → ')
