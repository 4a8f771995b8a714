"""A local HTTP server on 127.0.0.1 that answers every request after a fixed latency.

``ThreadingHTTPServer`` handles each request on its own thread, so requests that arrive
together wait their latency together: the server is never the bottleneck, the client's
concurrency is what a benchmark measures. Supports HEAD, GET and single byte ranges.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


@dataclass
class LatencyServer:
    """Serves ``files`` (name -> bytes) at ``http://127.0.0.1:<port>/<name>``, ``latency_s`` late."""

    files: dict[str, bytes]
    latency_s: float = 0.1
    requests: Counter[str] = field(default_factory=Counter)  # method -> count
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "the server is not started"
        return int(self._server.server_address[1])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def count(self, method: str) -> None:
        with self._lock:
            self.requests[method] += 1

    def served(self) -> int:
        """Requests served so far."""
        with self._lock:
            return sum(self.requests.values())

    def __enter__(self) -> LatencyServer:
        server = _Server(("127.0.0.1", 0), _handler(self))
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="latency-server").start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Server(ThreadingHTTPServer):
    # listen() backlog: the default of 5 drops some of 8+ simultaneous connects, and the
    # client's SYN retransmit then adds a whole second to a request.
    request_queue_size = 128
    daemon_threads = True


def _handler(state: LatencyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, *, body: bool) -> None:
            state.count(self.command)
            time.sleep(state.latency_s)
            data = state.files.get(self.path.lstrip("/"))
            if data is None:
                self.send_error(404)
                return
            start, end = 0, len(data)
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if match:
                start, end = int(match[1]), min(len(data), int(match[2] or len(data) - 1) + 1)
            self.send_response(206 if match else 200)
            if match:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Type", "text/csv")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])

    return Handler
