"""Retries for remote reads: exponential backoff with jitter, for transient failures only.

A failure is *transient* when trying again may help: an HTTP 5xx, 408 or 429, a timeout,
a refused, reset or dropped connection, a short or corrupted transfer. Everything else
(404, 403, a CSV that does not parse, a bug) is *permanent* and fails at once: retrying
it only delays the error. Library exceptions are matched by class name, so aiohttp and
botocore stay optional imports (they come with fsspec's http and s3 backends).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Exception classes (or base classes) of aiohttp, botocore, http.client, fsspec and s3fs
# that mean "the transfer broke", whatever the status of the resource.
_TRANSIENT_NAMES = frozenset({
    "ClientConnectionError",  # aiohttp: refused, reset, server disconnected, socket timeouts
    "ClientPayloadError",  # aiohttp: body shorter than Content-Length, bad chunking
    "HTTPClientError",  # botocore: connection closed, read timeout
    "ConnectionError",  # botocore's own (endpoint unreachable, connect timeout); also the builtin
    "IncompleteRead",  # http.client / urllib3
    "ResponseStreamingError",  # botocore: body stream broke
    "FSTimeoutError",  # fsspec: sync() timed out
    "TransferIncomplete",  # ours: fewer bytes than the source announced, or a bad checksum
})
_TRANSIENT_STATUS = frozenset({408, 425, 429})


class Cancelled(Exception):
    """The stage is failing (another source failed, or Ctrl-C): stop without retrying."""


class TransferIncomplete(OSError):
    """A transfer ended with the wrong size or checksum: the bytes were damaged on the way."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry one remote read (``ingest.retry`` params).

    The n-th retry waits ``min(max_delay_s, initial_delay_s * multiplier ** (n - 1))``,
    less a random share of up to ``jitter`` of it, so that many threads that failed
    together do not all come back at the same instant.
    """

    attempts: int = 5
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be {rule}, got {value}"
            for name, value, ok, rule in (
                ("attempts", self.attempts, self.attempts >= 1, ">= 1"),
                ("initial_delay_s", self.initial_delay_s, self.initial_delay_s >= 0, ">= 0"),
                ("max_delay_s", self.max_delay_s, self.max_delay_s >= self.initial_delay_s, ">= initial_delay_s"),
                ("multiplier", self.multiplier, self.multiplier >= 1, ">= 1"),
                ("jitter", self.jitter, 0 <= self.jitter <= 1, "in [0, 1]"),
            )
            if not ok
        ]
        if problems:
            raise ValueError("retry: " + "; ".join(problems))

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RetryPolicy:
        params = dict(params or {})
        unknown = sorted(set(params) - {"attempts", "initial_delay_s", "max_delay_s", "multiplier", "jitter"})
        if unknown:
            raise ValueError(f"retry: unknown keys {unknown}")
        defaults = cls()
        return cls(
            attempts=int(params.get("attempts", defaults.attempts)),
            initial_delay_s=float(params.get("initial_delay_s", defaults.initial_delay_s)),
            max_delay_s=float(params.get("max_delay_s", defaults.max_delay_s)),
            multiplier=float(params.get("multiplier", defaults.multiplier)),
            jitter=float(params.get("jitter", defaults.jitter)),
        )

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 is the first retry)."""
        base = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (retry - 1))
        return base * (1.0 - self.jitter * rng.random())


class GaveUp(Exception):
    """A read failed for good; says how many attempts it took and why it stopped."""

    def __init__(self, attempts: int, error: BaseException, *, transient: bool) -> None:
        super().__init__(attempts, error)
        self.attempts = attempts
        self.error = error
        self.transient = transient

    def __str__(self) -> str:
        what = describe(self.error)
        if self.transient:
            plural = "s" if self.attempts > 1 else ""
            return f"gave up after {self.attempts} attempt{plural}; last error: {what}"
        tried = f"after {self.attempts} attempts" if self.attempts > 1 else "on attempt 1"
        return f"permanent error {tried}, not retried: {what}"


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help. An HTTP status anywhere in the cause chain decides
    (fsspec reports a 503 on HEAD and GET as FileNotFoundError *from* the 503);
    without one, a broken connection, timeout or damaged transfer is transient."""
    chain = list(_causes(exc))
    for error in chain:
        status = _http_status(error)
        if status is not None:
            return status >= 500 or status in _TRANSIENT_STATUS
    return any(_is_transient_type(error) for error in chain)


def describe(exc: BaseException) -> str:
    """``Type: message``, and the HTTP error behind it when a library wrapped one
    (fsspec turns a failed HEAD and GET into FileNotFoundError), or the cause of an
    error without a message (fsspec's FSTimeoutError)."""
    causes = list(_causes(exc))[1:]
    if not str(exc):
        return f"{type(exc).__name__} (from {describe(causes[0])})" if causes else type(exc).__name__
    text = f"{type(exc).__name__}: {exc}"
    for cause in causes:
        if _http_status(cause) is not None:
            return f"{text} (from {type(cause).__name__}: {cause})"
    return text


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    cancel: threading.Event | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """``fn()``, retried per ``policy`` on transient errors; raises :class:`GaveUp`.

    ``on_retry(attempt, error, delay)`` hears of each failed attempt that will be retried.
    ``cancel`` set: stop before the next attempt (the backoff wait wakes up at once).
    """
    rng = random.Random()  # noqa: S311 - jitter, not cryptography
    for attempt in range(1, policy.attempts + 1):
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        try:
            return fn()
        except Cancelled:
            raise
        except Exception as exc:
            transient = is_transient(exc)
            if not transient or attempt == policy.attempts:
                raise GaveUp(attempt, exc, transient=transient) from exc
            delay = policy.delay(attempt, rng)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            if cancel is not None:
                if cancel.wait(delay):
                    raise Cancelled() from exc
            else:
                time.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or during, outermost first, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an aiohttp or botocore error carries, if any."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _is_transient_type(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)
