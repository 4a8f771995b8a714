"""A local HTTP server on 127.0.0.1, in a process of its own, that answers every request after a fixed latency.

It plays a remote server (an object store, a web server): it runs in its own process, so
handling its requests takes no time under the ingest's GIL, and it speaks HTTP/1.1 with
keep-alive and no Nagle delay, as such servers do (an HTTP/1.0 server costs the client a new
connection per request; a keep-alive one that lets Nagle hold the body back costs a 40 ms
delayed ACK per response). ``ThreadingHTTPServer`` handles each connection on its own thread,
so requests that arrive together wait their latency together: the server is never the
bottleneck, the client's concurrency is what a benchmark measures. Supports HEAD, GET and
single byte ranges, and notes when each request arrives (``time.perf_counter``: on Linux the
system's monotonic clock, the same in every process).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

START_TIMEOUT_S = 60.0


@dataclass
class LatencyServer:
    """Serves ``files`` (name -> bytes) at ``http://127.0.0.1:<port>/<name>``, ``latency_s`` late."""

    files: dict[str, bytes]
    latency_s: float = 0.1
    _port: int | None = None
    _process: BaseProcess | None = None
    _conn: Connection | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        assert self._port is not None, "the server is not started"
        return self._port

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def arrivals(self) -> list[tuple[str, float]]:
        """(method, ``time.perf_counter()``) of every request so far, as it reached the server."""
        assert self._conn is not None, "the server is not started"
        self._conn.send("arrivals")
        arrived: list[tuple[str, float]] = self._conn.recv()
        return arrived

    def served(self) -> int:
        """Requests served so far."""
        return len(self.arrivals())

    def __enter__(self) -> LatencyServer:
        spawn = multiprocessing.get_context("spawn")
        here, there = spawn.Pipe()
        self._process = spawn.Process(target=_serve, args=(self.files, self.latency_s, there), daemon=True,
                                      name="latency-server")
        self._process.start()
        there.close()
        if not here.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the latency server did not start within {START_TIMEOUT_S:g} s")
        self._port, self._conn = here.recv(), here
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):  # it is gone already
                self._conn.send("stop")
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._process = None


def _serve(files: dict[str, bytes], latency_s: float, conn: Connection) -> None:
    """The server process: serve until the parent says stop or goes away."""
    arrivals: list[tuple[str, float]] = []
    lock = threading.Lock()

    def arrive(method: str) -> None:
        with lock:
            arrivals.append((method, time.perf_counter()))

    server = _Server(("127.0.0.1", 0), _handler(files, latency_s, arrive))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                     name="latency-server").start()
    conn.send(int(server.server_address[1]))
    try:
        while conn.recv() == "arrivals":
            with lock:
                conn.send(list(arrivals))
    except EOFError:
        pass  # the parent is gone
    finally:
        server.shutdown()
        server.server_close()


class _Server(ThreadingHTTPServer):
    # listen() backlog: the default of 5 drops some of 8+ simultaneous connects, and the
    # client's SYN retransmit then adds a whole second to a request.
    request_queue_size = 128
    daemon_threads = True


def _handler(files: dict[str, bytes], latency_s: float, arrive: Callable[[str], None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connections
        disable_nagle_algorithm = True  # a response's body goes out with its headers

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, *, body: bool) -> None:
            arrive(self.command)
            time.sleep(latency_s)
            data = files.get(self.path.lstrip("/"))
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
