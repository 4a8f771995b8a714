"""``conveyor serve-model``: the project's model over HTTP (FastAPI on uvicorn).

``POST /predict`` takes ``{"rows": [{feature: number, ...}, ...]}`` and answers
``{"scores": [...], "model": VERSION}``; ``GET /model`` is the model card, ``GET /health``
says the service is up, ``/openapi.json`` and ``/docs`` describe it. A request is checked
before it is scored: a body larger than ``max_body`` or more than ``max_rows`` rows is 413; a
missing, extra or non-numeric field is 422 naming it (FastAPI's ``detail`` list, ``loc`` down
to the row and column). The OpenAPI schema of ``/predict`` lists the features of the model
being served, in order.

With ``--model champion`` the service follows the registry: a thread watches the registry
file (and, before any promotion, the latest run's record); when the champion changes it
loads the new version beside the old one and then swaps one reference, so requests already
being scored finish on the old model and every later one gets the new: no request fails
or waits for a load. A version that does not load is reported and the old one kept.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from conveyor.errors import UsageError, redact
from conveyor.predict.model import CHAMPION, ModelVersion, Scorer, load_scorer, model_spec, resolve, shown

if TYPE_CHECKING:
    from conveyor.spec.models import ModelSpec
    from conveyor.spec.project import Project

log = logging.getLogger("conveyor.serve")
WATCH_EVERY_S = 1.0


def size_of(text: str) -> int:
    """Bytes in a size like ``16MiB`` (the spec's memory sizes)."""
    from conveyor.spec.base import size_in_bytes

    try:
        return size_in_bytes(text)
    except ValueError:
        raise UsageError(f"{text}: write a size like 16MiB") from None


class Served:
    """A loaded model version with what a request is checked against."""

    def __init__(self, scorer: Scorer, max_rows: int, root: Path) -> None:
        self.scorer, self.root = scorer, root
        self.model = scorer.model
        number = Annotated[float, Field(allow_inf_nan=False)]
        row = with_config(ConfigDict(extra="forbid"))(
            TypedDict("Row", dict.fromkeys(self.model.features, number)))  # type: ignore[operator]
        rows = Annotated[list[row], Field(min_length=1, max_length=max_rows)]  # type: ignore[valid-type]
        request = with_config(ConfigDict(extra="forbid"))(
            TypedDict("PredictRequest", {"rows": rows}))  # type: ignore[operator]
        self.request: TypeAdapter[Any] = TypeAdapter(request)

    @property
    def card(self) -> dict[str, Any]:
        model = self.model
        return {"version": model.version, "source": model.source, "features": list(model.features),
                "files": {name: shown(path, self.root) for name, path in model.files.items()}, **model.card}


class Live:
    """The version being served; :meth:`watch` swaps it when the champion changes."""

    def __init__(self, project: Project, which: str, max_rows: int) -> None:
        self.project, self.which, self.max_rows = project, which, max_rows
        self.spec: ModelSpec = model_spec(project)
        self.current = self._load(resolve(project, which))
        self._seen = self._signature()

    def _load(self, model: ModelVersion) -> Served:
        return Served(load_scorer(self.project.root, self.spec, model), self.max_rows, self.project.root)

    def _signature(self) -> tuple[Any, ...]:
        from conveyor.workspace import STATE_DIR

        def stat(path: Path) -> tuple[int, int, int] | None:
            with suppress(OSError):
                st = path.stat()
                return st.st_mtime_ns, st.st_size, st.st_ino
            return None

        root = self.project.root
        return stat(root / self.spec.registry), stat(root / STATE_DIR / "runs" / "latest.json")

    def refresh(self) -> bool:
        """Serve the champion now in the registry (or the latest successful run's model); True if swapped."""
        if self.which != CHAMPION:
            return False
        signature = self._signature()
        if signature == self._seen:
            return False
        self._seen = signature
        if not self._settled():
            return False  # a run is writing the model's files: wait for its record
        model = resolve(self.project, CHAMPION)
        if model.version == self.current.model.version:
            return False
        served = self._load(model)  # beside the old one: requests go on meanwhile
        old, self.current = self.current, served
        log.warning("now serving model %s (%s), was %s", model.version, model.source, old.model.version)
        return True

    def _settled(self) -> bool:
        """Whether the files to serve are whole: a champion's copies, or a latest run that succeeded."""
        from conveyor.models import registry as reg
        from conveyor.run.record import read_latest

        champion = reg.load(self.project.root / self.spec.registry).champion
        if champion is not None and champion.files:
            return True
        latest = read_latest(self.project.root)
        return latest is None or latest.status == "succeeded"

    def watch(self, stop: threading.Event, every: float = WATCH_EVERY_S) -> None:
        while not stop.wait(every):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a bad new version must not stop the service
                log.error("kept model %s: the new champion could not be loaded (%s)",
                          self.current.model.version, redact(str(exc)) or type(exc).__name__)


# --------------------------------------------------------------------------- the app


class Scores(BaseModel):
    """One score per row, in order (null where the model gave no finite number), and the model's version."""

    scores: list[float | None]
    model: str


class Problem(BaseModel):
    detail: str


class FieldProblem(BaseModel):
    loc: list[str | int]  # "body", "rows", the row's index, the column
    msg: str
    type: str


class Invalid(BaseModel):
    detail: list[FieldProblem]


def create_app(live: Live, *, max_body: int, watch_every: float = WATCH_EVERY_S) -> FastAPI:
    """The service's FastAPI app; with ``watch_every`` > 0 it follows the champion while it runs."""
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        watcher = threading.Thread(target=live.watch, args=(stop, watch_every), name="conveyor-champion-watch",
                                   daemon=True)
        if watch_every > 0 and live.which == CHAMPION:
            watcher.start()
        try:
            yield
        finally:
            stop.set()

    name = live.project.pipeline.pipeline
    app = FastAPI(title=f"{name} model", version=live.current.model.version, lifespan=lifespan,
                  description=f"Scores rows with the model of the conveyor project {name}.")

    @app.post("/predict", response_model=Scores, responses={
        413: {"model": Problem, "description": "Body or row count over the service's limits"},
        422: {"model": Invalid, "description": "A field is missing, extra or not a finite number: `loc` names it"}})
    async def predict(request: Request) -> Scores | JSONResponse:
        """Score rows: each row holds every feature of the model (GET /model lists them), as a number."""
        body = await _read(request, max_body)
        if isinstance(body, JSONResponse):
            return body
        served = live.current  # one version for the whole request, even if the champion changes now
        try:
            rows = served.request.validate_json(body)["rows"]
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            if any(e["type"] == "too_long" and tuple(e["loc"]) == ("rows",) for e in errors):
                return _problem(413, f"more than {live.max_rows} rows in one request: send them in parts")
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
        try:
            scores = await run_in_threadpool(_score, served.scorer, rows)
        except Exception as exc:  # the project's scorer failed: say so, in JSON, and log it
            log.exception("model %s failed on %d rows", served.model.version, len(rows))
            why = redact(str(exc))[:400] or type(exc).__name__
            return _problem(500, f"model {served.model.version} could not score these rows ({why}); "
                                 "the service's log has the traceback")
        return Scores(scores=scores, model=served.model.version)

    @app.get("/model")
    def model() -> dict[str, Any]:
        """The model card: version, features in order, where the files came from, metrics, when promoted."""
        return live.current.card

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": live.current.model.version}

    def openapi() -> dict[str, Any]:
        """The schema of the version being served (its features), made anew: the champion may change."""
        schema = get_openapi(title=app.title, version=live.current.model.version, description=app.description,
                             routes=app.routes)
        body = live.current.request.json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(body.pop("$defs", {}))
        components["PredictRequest"] = {**body, "title": "PredictRequest"}
        ref = {"$ref": "#/components/schemas/PredictRequest"}
        schema["paths"]["/predict"]["post"]["requestBody"] = {"required": True,
                                                              "content": {"application/json": {"schema": ref}}}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _read(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or a 413 response as soon as it is over ``limit`` bytes (declared or sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return _problem(413, f"request body of {int(declared):,} bytes: at most {limit:,} are read")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _problem(413, f"request body over {limit:,} bytes: send the rows in parts")
        chunks.append(chunk)
    return b"".join(chunks)


def _problem(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _score(scorer: Scorer, rows: list[Mapping[str, float]]) -> list[float | None]:
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame.from_records(rows, columns=list(scorer.model.features))
    scores = scorer.score(frame)
    return [float(s) if np.isfinite(s) else None for s in scores]


# --------------------------------------------------------------------------- the server


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
ACCESS = ("info", "debug", "trace")  # the levels that show a line per request


def serve(project: Project, which: str, *, host: str = "127.0.0.1", port: int = 8000, max_rows: int = 10_000,
          max_body: str = "16MiB", log_level: str = "warning") -> None:
    """Load the model, then serve it until SIGINT/SIGTERM (uvicorn stops gracefully). ``log_level``:
    uvicorn's; its access lines (one per request) show from ``info`` down."""
    import uvicorn

    limit = size_of(max_body)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    live = Live(project, which, max_rows)
    sock = _bind(host, port)
    url_host = f"[{host}]" if ":" in host else host
    model = live.current.model
    print(f"serving model {model.version} ({model.source}) at http://{url_host}:{sock.getsockname()[1]} "
          f"(OpenAPI at /docs; Ctrl-C stops)", flush=True)
    config = uvicorn.Config(create_app(live, max_body=limit), log_level=log_level, access_log=log_level in ACCESS,
                            timeout_graceful_shutdown=10)
    uvicorn.Server(config).run(sockets=[sock])


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); "
                         "pick another port (--port 0 takes a free one)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
