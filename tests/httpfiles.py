"""A flaky HTTP server on 127.0.0.1 (stdlib ``http.server`` in a thread) for the ingest's tests: it
adds latency and injects faults from a plan keyed by (method, path, Range, n-th such request), so
which request fails is the same on every run however the ingest threads interleave; and
:func:`serving`, a loopback server of any handler for a block."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (method, path, range header or "", n-th request with those three) -> fault, or None to serve
FaultPlan = Callable[[str, str, str, int], str | None]



@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """A ThreadingHTTPServer of ``handler`` on a free loopback port, in a thread, for the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()

@dataclass
class FlakyServer:
    """Serves ``files`` over HTTP/1.0 with latency, Range support, a Content-MD5 header, a
    non-md5 ETag, GETs held until :attr:`held` is set, and the faults its plan names:
    500/503/403/404, ``drop`` (half the body, then close), ``reset`` (half the body, then a TCP
    RST), ``stall`` (answer after ``stall_s``), ``corrupt`` (one byte flipped, same length). A
    reset *before* the response would not reach ingest: aiohttp retries an idempotent request
    once itself."""

    files: dict[str, bytes]
    plan: FaultPlan = lambda method, path, rng, n: None
    latency_s: float = 0.005
    stall_s: float = 6.0  # well past the client's timeout, even on a loaded machine
    barrier: threading.Barrier | None = None  # GETs wait for each other here
    held: threading.Event | None = None  # GETs wait until it is set: a transfer surely under way
    asked: threading.Event = field(default_factory=threading.Event)  # set by the first GET
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    broken_barriers: int = 0
    _seen: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    def fault(self, method: str, path: str, rng: str) -> str | None:
        with self._lock:
            self.requests[(method, path)] += 1
            self._seen[(method, path, rng)] += 1
            n = self._seen[(method, path, rng)]
        return self.plan(method, path, rng, n)


def _handler(state: FlakyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.serve(body=False)

        def do_GET(self) -> None:
            self.serve(body=True)

        def serve(self, *, body: bool) -> None:
            path = self.path.lstrip("/")
            fault = state.fault(self.command, path, self.headers.get("Range", ""))
            time.sleep(state.latency_s)
            if body:
                state.asked.set()
                if state.held is not None:
                    state.held.wait(300)
            if body and state.barrier is not None:
                try:
                    state.barrier.wait()
                except threading.BrokenBarrierError:
                    state.broken_barriers += 1
                    fault = "503"
            if fault is None and path not in state.files:
                fault = "404"
            if fault == "stall":
                time.sleep(state.stall_s)
            if fault is not None and fault.isdigit():
                self.send_error(int(fault))
                return
            self.send_body(state.files[path], body=body, fault=fault)

        def send_body(self, data: bytes, *, body: bool, fault: str | None) -> None:
            start, end = 0, len(data)
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if match:
                start, end = int(match[1]), min(len(data), int(match[2] or len(data) - 1) + 1)
            self.send_response(206 if match else 200)
            if match:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", '"not-an-md5"')
            self.send_header("Content-MD5", base64.b64encode(hashlib.md5(data).digest()).decode())
            self.end_headers()
            if not body:
                return
            payload = data[start:end]
            if fault == "corrupt":
                payload = payload[:10] + bytes([payload[10] ^ 1]) + payload[11:]
            if fault in ("drop", "reset"):
                payload = payload[: len(payload) // 2]
            if fault == "reset":  # RST instead of FIN when the socket closes
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):  # the client gave up (a stalled answer)
                self.wfile.write(payload)

    return Handler
