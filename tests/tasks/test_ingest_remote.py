"""Ingest from real servers on 127.0.0.1: a flaky HTTP server and a moto S3 server.

The HTTP server is :class:`httpfiles.FlakyServer`: latency and faults from a plan keyed by
(method, path, Range, n-th such request), the same on every run however the ingest threads
interleave.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from httpfiles import FlakyServer
from stagebench import StageBench

from conveyor.ingest.fetch import SourceError
from tasks import ingest

COLUMNS = ["a", "b", "c", "d", "label"]
FAST_RETRY = {"attempts": 4, "initial_delay_s": 0.01, "max_delay_s": 0.05, "jitter": 0.5}


def csv_bytes(rows: int, seed: int) -> bytes:
    """A CSV file with a header line and ``rows`` rows of floats."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.normal(size=(rows, len(COLUMNS))).round(6), columns=COLUMNS)
    return frame.to_csv(index=False).encode()


def expected(*bodies: bytes) -> pd.DataFrame:
    frames = [pd.read_csv(io.BytesIO(body), skiprows=1, header=None, names=COLUMNS) for body in bodies]
    return pd.concat(frames, ignore_index=True).astype("float64")


def ingested(root: Path) -> pd.DataFrame:
    parts = sorted((root / "data/raw").glob("part-*.parquet"))
    return pd.concat([pd.read_parquet(part) for part in parts], ignore_index=True)


def leftovers(root: Path) -> list[Path]:
    """Hidden files (temporaries of parts and downloads) anywhere under the project root."""
    return [p for p in root.rglob(".*") if p.is_file() and ".conveyor" not in p.relative_to(root).parts]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def serve() -> Iterator[Callable[..., FlakyServer]]:
    """Start FlakyServers for one test; all are shut down after it."""
    servers: list[ThreadingHTTPServer] = []

    def start(files: dict[str, bytes], **options: Any) -> FlakyServer:
        state = FlakyServer(files, **options)
        servers.append(state.start())
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_ingest(bench: StageBench, sources: list[Any], *, workers: int = 4, **params: Any) -> None:
    options = {"sources": sources, "columns": COLUMNS, "dtype": "float64", "skip_rows": 1, "mode": "files",
               "retry": FAST_RETRY, "timeout_s": 5, **params}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        bench.run(ingest.fetch, params=["ingest"], outs=["data/raw"], executor=pool, overrides={"ingest": options})


# --- HTTP: transient faults are retried, every byte arrives -----------------------------


def test_http_files_arrive_intact_through_503_drop_reset_stall_and_corruption(
    bench: StageBench, serve: Callable[..., FlakyServer], caplog: pytest.LogCaptureFixture
) -> None:
    faults = {"a.csv": "503", "b.csv": "drop", "c.csv": "reset", "d.csv": "stall", "e.csv": "corrupt"}
    files = {name: csv_bytes(2000, seed) for seed, name in enumerate(faults)}
    server = serve(files, plan=lambda method, path, rng, n: faults[path] if method == "GET" and n == 1 else None)
    md5_a = hashlib.md5(files["a.csv"]).hexdigest()
    sources = [{"url": server.url("a.csv"), "md5": md5_a}, *(server.url(name) for name in list(files)[1:])]

    with caplog.at_level(logging.DEBUG, logger="tests.fetch"):
        run_ingest(bench, sources, timeout_s=2.0)  # a healthy request never takes 2 s, even under CI load

    pd.testing.assert_frame_equal(ingested(bench.root), expected(*files.values()))
    assert {path: server.requests[("GET", path)] for path in files} == dict.fromkeys(files, 2)  # one retry each
    assert not [request for request in server.requests if request[0] == "HEAD"]  # size and md5: from the GET
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    # Every file was fetched twice (above). Ours retried each, except that a reset which lands
    # before the response headers is retried by aiohttp itself (an idempotent GET): then c.csv
    # has no line of ours. Which one happens is up to the scheduler.
    assert {line.split(":")[2].split("/")[-1] for line in retried} >= set(faults) - {"c.csv"}
    assert len(retried) in (4, 5)
    assert any("md5" in line and "does not match" in line for line in retried)  # e.csv, by its Content-MD5
    checked = [r.getMessage() for r in caplog.records if "bytes arrived" in r.getMessage()]
    assert sum("md5 params" in line for line in checked) == 1
    assert sum("md5 Content-MD5" in line for line in checked) == 4
    assert leftovers(bench.root) == []
    progress = bench.contexts[-1].progress
    assert progress.total == pytest.approx(sum(map(len, files.values())) / 1e6)
    assert progress.completed == pytest.approx(progress.total)  # failed attempts are not counted twice
    assert re.fullmatch(r"5/5 files, [\d.]+ MB/s", progress.description)


def test_a_third_of_all_requests_failing_still_delivers_every_byte(
    bench: StageBench, serve: Callable[..., FlakyServer], caplog: pytest.LogCaptureFixture
) -> None:
    """30% of all requests (listings, transfers, ranges) answered 503, 500 or cut short."""
    files = {f"part{i:02d}.csv": csv_bytes(500, 100 + i) for i in range(12)}

    def plan(method: str, path: str, rng: str, n: int) -> str | None:
        digest = hashlib.sha256(f"{method} {path} {rng} {n}".encode()).digest()
        return ("503", "500", "drop")[digest[1] % 3] if digest[0] % 10 < 3 and n < 4 else None

    server = serve(files, plan=plan)
    with caplog.at_level(logging.WARNING, logger="tests.fetch"):
        run_ingest(bench, [server.url(name) for name in files], timeout_s=2.0)

    pd.testing.assert_frame_equal(ingested(bench.root), expected(*files.values()))
    requests = sum(server.requests.values())
    failed = sum(1 for line in caplog.records if "retrying in" in line.getMessage())
    assert failed >= 0.15 * requests, (failed, requests)  # the plan did fail a good share of them
    assert leftovers(bench.root) == []


def test_http_blocks_mode_rereads_only_the_failed_ranges(bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    body = csv_bytes(3000, seed=7)  # about 130 KB: 17 blocks of 8000 bytes
    server = serve({"big.csv": body}, plan=lambda method, path, rng, n: "503" if rng and n == 1 else None)

    run_ingest(bench, [server.url("big.csv")], mode="blocks", block_size=8000)

    pd.testing.assert_frame_equal(ingested(bench.root), expected(body))
    blocks = len(list((bench.root / "data/raw").glob("part-*.parquet")))
    assert blocks == -(-len(body) // 8000)
    gets = {rng: n for (method, _, rng), n in server._seen.items() if method == "GET"}
    assert len(gets) >= blocks and all(gets)  # ranged reads only: no block re-read the whole file
    assert set(gets.values()) == {2}  # every range failed once and was served on its retry


# --- HTTP: permanent failures fail at once, with the URL and the attempts -------------


@pytest.mark.parametrize("fault", ["500", "drop"])
def test_always_failing_source_names_url_and_attempts_and_leaves_no_partial_file(
    bench: StageBench, serve: Callable[..., FlakyServer], fault: str
) -> None:
    files = {"good.csv": csv_bytes(500, 1), "down.csv": csv_bytes(50_000, 2)}
    server = serve(files, plan=lambda method, path, rng, n: fault if method == "GET" and path == "down.csv" else None)

    error = r"gave up after 4 attempts; last error: " + ("ClientResponseError: 500" if fault == "500" else ".*Payload")
    with pytest.raises(SourceError, match=rf"cannot ingest source '{server.url('down.csv')}': {error}"):
        run_ingest(bench, [server.url("good.csv"), server.url("down.csv")])

    assert server.requests[("GET", "down.csv")] == 4
    assert leftovers(bench.root) == []  # no half download, no half-written part


@pytest.mark.parametrize(("name", "status"), [("missing.csv", "404"), ("secret.csv", "403")])
def test_404_and_403_are_not_retried(
    bench: StageBench, serve: Callable[..., FlakyServer], name: str, status: str
) -> None:
    server = serve({"secret.csv": b"x\n1,2,3,4,5\n"},
                   plan=lambda method, path, rng, n: "403" if path == "secret.csv" else None)

    with pytest.raises(SourceError, match=rf"'{server.url(name)}': permanent error on attempt 1, not retried"):
        run_ingest(bench, [server.url(name)])

    assert server.requests == {("GET", name): 1}  # files mode lists a URL without a HEAD: one GET


def test_unparsable_csv_is_not_retried(bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    server = serve({"bad.csv": b"a,b,c,d,label\n1,2,3,4,5\n1,2,three,4,5\n"})

    with pytest.raises(SourceError, match=rf"'{server.url('bad.csv')}': .*bad\.csv: line 3, column 'c': "
                                          r"'three' cannot be read as float64"):
        run_ingest(bench, [server.url("bad.csv")])

    assert server.requests[("GET", "bad.csv")] == 1
    assert leftovers(bench.root) == []


def test_wrong_md5_in_params_fails_after_the_retries(bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    server = serve({"a.csv": csv_bytes(100, 3)})

    with pytest.raises(SourceError, match=r"gave up after 4 attempts; .*TransferIncomplete: md5 \w+ does not "
                                                 r"match 0{32} \(params\)"):
        run_ingest(bench, [{"url": server.url("a.csv"), "md5": "0" * 32}])


# --- concurrency ------------------------------------------------------------------------


def test_four_transfers_are_in_flight_at_once(bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    """Each GET waits until four are in flight: a serial ingest would break the barrier."""
    files = {f"{i}.csv": csv_bytes(300, i) for i in range(8)}
    server = serve(files, barrier=threading.Barrier(4, timeout=10))

    run_ingest(bench, [server.url(name) for name in files], workers=4)

    assert server.broken_barriers == 0
    pd.testing.assert_frame_equal(ingested(bench.root), expected(*files.values()))


def test_the_barrier_catches_a_serial_ingest(bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    """The control for the test above: one worker cannot gather four requests."""
    server = serve({f"{i}.csv": csv_bytes(10, i) for i in range(4)}, barrier=threading.Barrier(4, timeout=0.5))

    with pytest.raises(SourceError, match="gave up after 2 attempts"):
        run_ingest(bench, [server.url(f"{i}.csv") for i in range(4)], workers=1, retry={**FAST_RETRY, "attempts": 2})
    assert server.broken_barriers >= 1


def test_files_parsed_beside_the_transfers_arrive_in_order_however_many_wait(
        bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    """Arrived files wait for their parse on a pool of their own, at most twice the stage pool's
    size of them: with 30 files on 2 threads, transfers wait for parses and none is lost."""
    files = {f"{i:02d}.csv": csv_bytes(200, i) for i in range(30)}
    server = serve(files)

    run_ingest(bench, [server.url(name) for name in files], workers=2)

    pd.testing.assert_frame_equal(ingested(bench.root), expected(*files.values()))
    assert leftovers(bench.root) == []


def test_a_bad_file_among_many_fails_the_stage_and_leaves_no_download_behind(
        bench: StageBench, serve: Callable[..., FlakyServer]) -> None:
    files = {f"{i:02d}.csv": csv_bytes(200, i) for i in range(20)}
    files["07.csv"] = b"a,b,c,d,label\n1,2,three,4,5\n"
    server = serve(files)

    with pytest.raises(SourceError, match=rf"'{server.url('07.csv')}': .*line 2, column 'c'"):
        run_ingest(bench, [server.url(name) for name in files], workers=4)

    assert leftovers(bench.root) == []  # no download awaiting its parse, no half-written part


# --- S3 (moto) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on loopback with bucket ``raw``: three CSVs under ``in/``, and
    objects the glob must not pick (another suffix, another prefix)."""
    import boto3  # type: ignore[import-untyped]
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket="raw")
    bodies = {f"in/{i}.csv": csv_bytes(1500, 10 + i) for i in range(3)}
    for key, body in {**bodies, "in/notes.txt": b"not csv", "other/3.csv": csv_bytes(5, 99)}.items():
        client.put_object(Bucket="raw", Key=key, Body=body)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    yield {"bodies": bodies, "storage_options": {"s3": options}}
    server.stop()


@pytest.mark.parametrize("mode", ["files", "blocks"])
def test_s3_glob_arrives_intact(
    bench: StageBench, s3: dict[str, Any], mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="tests.fetch"):
        run_ingest(bench, ["s3://raw/in/*.csv"], mode=mode, block_size=20_000, storage_options=s3["storage_options"])

    pd.testing.assert_frame_equal(ingested(bench.root), expected(*s3["bodies"].values()))
    if mode == "files":  # single-part uploads: the ETag is the md5, and it was checked
        checked = [r.getMessage() for r in caplog.records if "bytes arrived" in r.getMessage()]
        assert len(checked) == 3 and all("md5 ETag" in line for line in checked)


def test_storage_options_are_keyed_by_protocol(bench: StageBench) -> None:
    with pytest.raises(ValueError, match=r"storage_options is keyed by protocol .*\['client_kwargs'\]"):
        run_ingest(bench, ["s3://raw/in/*.csv"], storage_options={"client_kwargs": {"endpoint_url": "x"}})


# --- the retry policy, without a server -------------------------------------------------


def test_backoff_grows_exponentially_up_to_the_cap_with_bounded_jitter() -> None:
    import random

    from conveyor.ingest.retry import RetryPolicy

    policy = RetryPolicy(attempts=8, initial_delay_s=0.5, max_delay_s=4.0, multiplier=2.0, jitter=0.25)
    rng = random.Random(0)
    delays = [[policy.delay(retry, rng) for _ in range(200)] for retry in range(1, 7)]
    for base, seen in zip([0.5, 1.0, 2.0, 4.0, 4.0, 4.0], delays, strict=True):
        assert base * 0.75 <= min(seen) and max(seen) <= base
        assert max(seen) - min(seen) > base * 0.2  # jitter spreads the retries
    assert RetryPolicy(jitter=0.0).delay(3, rng) == 2.0
    with pytest.raises(ValueError, match=r"retry: attempts must be >= 1, got 0; jitter must be in \[0, 1\]"):
        RetryPolicy(attempts=0, jitter=2.0)


def test_which_errors_are_transient() -> None:
    import aiohttp
    from botocore.exceptions import ClientError, EndpointConnectionError  # type: ignore[import-untyped]

    from conveyor.ingest.retry import TransferIncomplete, is_transient

    def http(status: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]

    def s3(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    def wrapped(cause: BaseException) -> FileNotFoundError:  # how fsspec reports a failed HEAD + GET
        error = FileNotFoundError("http://host/x.csv")
        error.__cause__ = cause
        return error

    transient = [http(503), http(500), http(429), wrapped(http(502)), s3(500, "InternalError"), s3(503, "SlowDown"),
                 TimeoutError(), ConnectionResetError(), EndpointConnectionError(endpoint_url="http://x"),
                 aiohttp.ServerDisconnectedError(), TransferIncomplete("short")]
    permanent = [http(404), http(403), wrapped(http(404)), s3(403, "AccessDenied"), s3(404, "NoSuchKey"),
                 FileNotFoundError("x"), PermissionError("x"), ValueError("could not convert 'five'")]
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)
