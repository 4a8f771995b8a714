"""A local HTTP server, a process of its own, that answers every request ``latency_s`` late, as a remote one would.

It takes no time under the client's GIL, keeps connections alive (HTTP/1.1) without Nagle's delay and gives each
connection a thread (requests that arrive together wait together: the client's concurrency is what is measured).
It notes when each request arrives (``time.perf_counter``: the system's monotonic clock) in a file the client reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO


class LatencyServer:
    """Serves ``files`` (name -> bytes) at ``http://127.0.0.1:<port>/<name>``, ``latency_s`` late."""

    def __init__(self, files: dict[str, bytes], latency_s: float = 0.1) -> None:
        self.files, self.latency_s, self.port = files, latency_s, 0
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-bench-latency-"))

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def arrivals(self) -> list[tuple[str, float]]:
        """(method, ``time.perf_counter()``) of every request so far, as it reached the server."""
        lines = (self.root / "arrivals").read_text().split("\n")[:-1]  # whole lines only: each is one write(2)
        return [(method, float(at)) for method, at in (line.split() for line in lines)]

    def __enter__(self) -> LatencyServer:
        for name, body in self.files.items():
            (self.root / name).write_bytes(body)
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(self.root), str(self.latency_s)], cwd=REPO,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self._proc.stdout.readline() or 0) if self._proc.stdout else 0
        if not self.port:
            raise RuntimeError(f"the latency server did not start (exit {self._proc.wait()})")
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.communicate(timeout=10)  # its stdin closed: it exits
        self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connections
    disable_nagle_algorithm = True  # a response's body goes out with its headers
    files: dict[str, bytes] = {}  # noqa: RUF012 - set once, before serving
    latency_s, log = 0.0, 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        os.write(self.log, f"{self.command} {time.perf_counter()!r}\n".encode())  # O_APPEND: one line, whole
        time.sleep(self.latency_s)
        data = self.files.get(self.path.lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        for key, value in (("Content-Type", "text/csv"), ("Content-Length", str(len(data)))):
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    do_HEAD = do_GET


if __name__ == "__main__":  # ``python -m benchmarks.compute.latency_server ROOT LATENCY_S``: serve ROOT's files
    root, _Handler.latency_s = Path(sys.argv[1]), float(sys.argv[2])
    _Handler.files = {path.name: path.read_bytes() for path in root.iterdir()}
    _Handler.log = os.open(root / "arrivals", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler, bind_and_activate=False)
    server.daemon_threads, server.request_queue_size = True, 128  # the default 5 drops some of 8+ connects: 1 s lost
    server.server_bind()
    server.server_activate()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()  # until the client closes it, or is gone
