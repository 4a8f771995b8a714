"""Data versioning of what `conveyor run` produced, with the real `dvc` and `git` CLIs.

`conveyor run`, in a DVC repo whose dvc.yaml was compiled from the spec, commits every
successful stage through DVC's API: hashes into dvc.lock, outs into the DVC cache. These
tests check that what it leaves behind is ordinary DVC data a user can version:

- pushed to a local remote and to an S3 remote (dvc-s3 against a real ``moto_server``
  on 127.0.0.1), and pulled back byte for byte into a wiped workspace and cache;
- checked out at an older git commit and back (``git checkout`` + ``dvc checkout``);
- compared with ``dvc metrics show`` / ``dvc metrics diff`` (metrics are ``cache: false``).

Each test builds its own throwaway git + DVC repository holding a tiny pipeline::

    make (io) ──► featurize ──► score
    data/raw.txt   data/features/   models/model.txt, metrics/score.json
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from projects import Project
from subprocs import stop_group

TASKS = '''
import json


def make(ctx):
    n = ctx.params["make"]["n"]
    ctx.outs["data/raw.txt"].write_text("".join(f"{i}\\n" for i in range(n)))


def featurize(ctx):
    values = [int(v) for v in ctx.deps["data/raw.txt"].read_text().split()]
    out = ctx.outs["data/features"]
    (out / "parts").mkdir(parents=True)
    (out / "sum.txt").write_text(str(sum(values)))
    for i, v in enumerate(values[:3]):
        (out / "parts" / f"{i}.txt").write_text(str(v) * 3)
    (out / "blob.bin").write_bytes(bytes(range(256)) * len(values))  # not text: byte-for-byte checks


def score(ctx):
    total = int((ctx.deps["data/features"] / "sum.txt").read_text())
    scale = ctx.params["score"]["scale"]
    ctx.outs["models/model.txt"].write_text(f"model total={total} scale={scale}\\n")
    ctx.metrics["metrics/score.json"].write_text(json.dumps({"total": total, "score": total * scale}))
'''

SPEC = """
pipeline: tiny
profiles:
  io: {kind: threads, max_workers: 2}
stages:
  make: {task: tasks.steps:make, on: io, params: [make], outs: [data/raw.txt]}
  featurize: {task: tasks.steps:featurize, deps: [data/raw.txt], outs: [data/features]}
  score:
    task: tasks.steps:score
    deps: [data/features]
    params: [score]
    outs: [models/model.txt]
    metrics: [metrics/score.json]
"""

OUTS = ("data/raw.txt", "data/features", "models/model.txt")  # cached by DVC
METRICS = "metrics/score.json"  # cache: false, versioned by git
STAGES = ("make", "featurize", "score")
UP_TO_DATE = "Data and pipelines are up to date."
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}  # no instance-metadata lookups off the loopback
LOOPBACK = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


# --- helpers -------------------------------------------------------------------------


def git(project: Project, *args: str) -> str:
    return project.sh("git", *args).stdout


def dvc(project: Project, *args: str) -> str:
    return project.sh("dvc", *args).stdout


def dvc_json(project: Project, *args: str) -> Any:
    return json.loads(dvc(project, *args, "--json") or "{}")


def run(project: Project, **expected: str) -> None:
    """`conveyor run`; each stage must end as ``expected`` says (all stages, by name)."""
    result = project.conveyor("run", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {n: s["status"] for n, s in project.record()["stages"].items()} == expected, result.stderr


def run_all(project: Project, status: str) -> None:
    run(project, **dict.fromkeys(STAGES, status))


def set_params(project: Project, n: int, scale: int) -> None:
    project.write("params.yaml", f"make: {{n: {n}}}\nscore: {{scale: {scale}}}\n")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the outs and the metrics, by path relative to the root."""
    files: dict[str, bytes] = {}
    for rel in (*OUTS, METRICS):
        path = root / rel
        if path.is_dir():
            files |= {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
        elif path.is_file():
            files[rel] = path.read_bytes()
    return files


def cache_object(root: Path, md5: str) -> Path:
    return root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def lock_outs(root: Path) -> dict[str, dict[str, Any]]:
    """The outs recorded in dvc.lock (metrics included, as DVC writes them), by path."""
    lock = yaml.safe_load((root / "dvc.lock").read_text(encoding="utf-8"))
    return {out["path"]: out for stage in lock["stages"].values() for out in stage.get("outs", [])}


def cached_files(root: Path) -> tuple[dict[str, str], set[str]]:
    """(workspace file -> md5 for every file DVC caches, the directories' ``.dir`` md5s), read
    from dvc.lock and the ``.dir`` listings in the local cache."""
    files: dict[str, str] = {}
    dirs: set[str] = set()
    outs = lock_outs(root)
    assert set(outs) == {*OUTS, METRICS}
    for path in OUTS:
        md5 = outs[path]["md5"]
        if md5.endswith(".dir"):
            dirs.add(md5)
            listing = json.loads(cache_object(root, md5).read_text(encoding="utf-8"))
            files |= {f"{path}/{item['relpath']}": item["md5"] for item in listing}
        else:
            files[path] = md5
    return files, dirs


def assert_committed_to_cache(project: Project, data_status: bool = True) -> set[str]:
    """Every out's bytes are in the DVC cache under the md5 dvc.lock records; returns the md5s
    of all cached objects (files and ``.dir`` listings). ``data_status``: ask `dvc data status` too."""
    root = project.root
    files, dirs = cached_files(root)
    workspace = {rel for rel in snapshot(root) if rel != METRICS}
    assert set(files) == workspace, "dvc.lock and the cache's .dir listing do not name the workspace's files"
    for rel, md5 in files.items():
        data = (root / rel).read_bytes()
        assert hashlib.md5(data).hexdigest() == md5, f"{rel}: workspace differs from dvc.lock"
        assert cache_object(root, md5).read_bytes() == data, f"{rel}: not in the DVC cache"
    assert lock_outs(root)["data/features"]["nfiles"] == len([f for f in files if f.startswith("data/features/")])
    if data_status:
        status = dvc_json(project, "data", "status")
        assert not status.get("uncommitted") and not status.get("not_in_cache"), status
    return {*files.values(), *dirs}


def assert_dvc_clean(project: Project) -> None:
    assert UP_TO_DATE in dvc(project, "status")


def wipe_cache_and_outs(project: Project) -> None:
    shutil.rmtree(project.root / ".dvc" / "cache")
    for rel in OUTS:
        path = project.root / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert not any((project.root / rel).exists() for rel in OUTS)


def push_wipe_pull(project: Project, rerun: bool) -> set[str]:
    """Run the pipeline, push, delete the outs and the cache, pull them back: byte for byte.

    ``rerun``: then `conveyor run` again, which must skip every stage. Returns the md5s of the
    objects that must now be on the remote.
    """
    run_all(project, "succeeded")
    assert_dvc_clean(project)
    objects = assert_committed_to_cache(project)
    before = snapshot(project.root)
    assert len(before) == 8  # raw.txt, features/{sum.txt, blob.bin, parts/0..2}, model.txt, score.json

    not_pushed = dvc_json(project, "status", "-c")
    assert set(not_pushed) >= set(OUTS) and set(not_pushed.values()) == {"new"}, not_pushed
    assert METRICS not in not_pushed  # cache: false, git keeps it
    dvc(project, "push")
    assert dvc_json(project, "status", "-c") == {}

    wipe_cache_and_outs(project)
    stale = dvc_json(project, "status")
    assert set(stale) == set(STAGES), stale  # DVC sees the outs gone
    dvc(project, "pull")
    assert snapshot(project.root) == before
    assert assert_committed_to_cache(project, data_status=False) == objects
    assert_dvc_clean(project)
    if rerun:
        run_all(project, "skipped")  # what was pulled is what conveyor recorded: nothing to redo
    return objects


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dvc_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DVC's user and site folders for the module's tests: nothing outside the tests' temporary
    folder (no test writes there: each remote is a project's own). One for all, so that the runs of
    every test have one environment and share its warm runner."""
    return tmp_path_factory.mktemp("dvc-dirs")


@pytest.fixture
def versioned(make_project: Callable[[], Project], dvc_dirs: Path) -> Project:
    """A git repo + DVC repo with the tiny pipeline compiled to dvc.yaml and committed."""
    project = make_project()
    project.env.update({
        "DVC_NO_ANALYTICS": "1",
        "DVC_SITE_CACHE_DIR": str(dvc_dirs / "site-cache"),
        "DVC_GLOBAL_CONFIG_DIR": str(dvc_dirs / "global"),
        "DVC_SYSTEM_CONFIG_DIR": str(dvc_dirs / "system"),
        "GIT_TERMINAL_PROMPT": "0",
        **LOOPBACK,
    })
    project.write("tasks/__init__.py", "")
    project.write("tasks/steps.py", TASKS)
    project.write("configs/pipeline.yaml", SPEC)
    project.write(".gitignore", ".conveyor/\n__pycache__/\n")  # as a project of conveyor init ignores it
    set_params(project, n=5, scale=2)
    git(project, "init", "-q")
    git(project, "config", "user.name", "conveyor tests")
    git(project, "config", "user.email", "tests@conveyor.invalid")
    git(project, "config", "commit.gpgsign", "false")
    dvc(project, "init", "-q")
    compiled = project.conveyor("compile")
    assert compiled.returncode == 0, compiled.stderr
    git(project, "add", "-A")
    git(project, "commit", "-qm", "tiny pipeline")
    return project


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `moto_server` (S3 over HTTP) on a free 127.0.0.1 port; yields its URL."""
    home = tmp_path_factory.mktemp("moto")
    port = free_port()
    env = {**os.environ, **AWS, **LOOPBACK}
    log = (home / "moto.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"moto_server exited with {proc.returncode}: see {home / 'moto.log'}"
            try:
                with direct.open(f"{url}/moto-api/", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"moto_server at {url} not up after 60s"
            time.sleep(0.2)
        yield url
    finally:
        stop_group(proc, timeout=20)
        log.close()


# --- tests ---------------------------------------------------------------------------


@pytest.mark.slow
def test_local_remote_push_then_pull_restores_outs(versioned: Project, tmp_path: Path) -> None:
    project = versioned
    remote = tmp_path / "remote"
    dvc(project, "remote", "add", "-d", "local", str(remote))
    git(project, "commit", "-qam", "a local DVC remote")

    objects = push_wipe_pull(project, rerun=True)

    on_remote = {p.relative_to(remote / "files" / "md5").as_posix().replace("/", "", 1)
                 for p in (remote / "files" / "md5").rglob("*") if p.is_file()}
    assert on_remote == objects


@pytest.mark.slow
def test_s3_remote_through_dvc_s3_against_moto(versioned: Project, moto_s3: str, tmp_path: Path) -> None:
    project = versioned
    project.env.update({**AWS, "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")})
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        project.env.pop(var, None)
    bucket = f"conveyor-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", endpoint_url=moto_s3, region_name=AWS["AWS_DEFAULT_REGION"],
                      aws_access_key_id=AWS["AWS_ACCESS_KEY_ID"], aws_secret_access_key=AWS["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=bucket)
    dvc(project, "remote", "add", "-d", "s3", f"s3://{bucket}/store")
    dvc(project, "remote", "modify", "s3", "endpointurl", moto_s3)
    git(project, "commit", "-qam", "an S3 DVC remote")

    objects = push_wipe_pull(project, rerun=False)

    listed = s3.list_objects_v2(Bucket=bucket, Prefix="store/")
    keys = {item["Key"] for item in listed.get("Contents", [])}
    assert not listed["IsTruncated"]
    assert keys == {f"store/files/md5/{md5[:2]}/{md5[2:]}" for md5 in objects}
    blob = lock_outs(project.root)["models/model.txt"]["md5"]
    body = s3.get_object(Bucket=bucket, Key=f"store/files/md5/{blob[:2]}/{blob[2:]}")["Body"].read()
    assert body == (project.root / "models/model.txt").read_bytes()


@pytest.mark.slow
def test_checkout_of_an_older_commit_brings_back_its_outs(versioned: Project) -> None:
    project = versioned
    run_all(project, "succeeded")
    tracked = git(project, "status", "--porcelain", "--untracked-files=all")
    assert not any(rel in tracked for rel in OUTS), f"outs not git-ignored after conveyor run:\n{tracked}"
    git(project, "add", "dvc.lock", METRICS, "data/.gitignore", "models/.gitignore")
    git(project, "commit", "-qm", "run 1")
    first = snapshot(project.root)

    set_params(project, n=9, scale=2)
    run_all(project, "succeeded")
    assert project.record()["stages"]["make"]["reason"] == "params changed: make.n 5 → 9"
    assert_dvc_clean(project)
    git(project, "add", "params.yaml", "dvc.lock", METRICS)
    git(project, "commit", "-qm", "run 2")
    assert git(project, "status", "--porcelain") == ""
    second = snapshot(project.root)
    assert set(second) == set(first)
    assert {rel for rel in first if first[rel] != second[rel]} == {
        "data/raw.txt", "data/features/sum.txt", "data/features/blob.bin", "models/model.txt", METRICS}

    git(project, "checkout", "-q", "HEAD~1")
    dvc(project, "checkout")
    assert snapshot(project.root) == first
    assert_dvc_clean(project)
    status = project.conveyor("status")
    assert status.returncode == 0 and status.stdout.count("up to date") == len(STAGES), status.stdout

    git(project, "checkout", "-q", "-")
    dvc(project, "checkout")
    assert snapshot(project.root) == second
    assert_dvc_clean(project)


@pytest.mark.slow
def test_dvc_metrics_show_and_diff_read_what_the_pipeline_wrote(versioned: Project) -> None:
    project = versioned
    run_all(project, "succeeded")
    written = json.loads((project.root / METRICS).read_text())
    assert written == {"total": 10, "score": 20}
    assert dvc_json(project, "metrics", "show") == {"": {"data": {METRICS: {"data": written}}}}
    assert project.sh("git", "check-ignore", "-q", METRICS, check=False).returncode == 1  # cache: false: git keeps it
    assert not (project.root / "metrics" / ".gitignore").exists()
    git(project, "add", "-A")
    git(project, "commit", "-qm", "run 1")

    set_params(project, n=5, scale=3)
    run(project, make="skipped", featurize="skipped", score="succeeded")
    assert project.record()["stages"]["score"]["reason"] == "params changed: score.scale 2 → 3"
    assert_dvc_clean(project)
    assert dvc_json(project, "metrics", "diff") == {METRICS: {"score": {"old": 20, "new": 30, "diff": 10}}}
    table = dvc(project, "metrics", "diff")
    assert "score" in table and "20" in table and "30" in table

    git(project, "commit", "-qam", "run 2")
    assert dvc_json(project, "metrics", "diff", "HEAD~1", "HEAD") == {
        METRICS: {"score": {"old": 20, "new": 30, "diff": 10}}}
    assert dvc_json(project, "metrics", "diff", "HEAD~1", "HEAD", "--all")[METRICS]["total"] == {
        "old": 10, "new": 10, "diff": 0}
    assert dvc_json(project, "metrics", "show") == {"": {"data": {METRICS: {"data": {"total": 10, "score": 30}}}}}


@pytest.mark.slow
def test_status_says_not_in_cache_when_only_the_cache_is_gone(versioned: Project) -> None:
    project = versioned
    run_all(project, "succeeded")
    shutil.rmtree(project.root / ".dvc" / "cache")  # a cleared or replaced cache dir; the outs stay
    assert all((project.root / rel).exists() for rel in OUTS)
    assert dvc(project, "status").count("not in cache") == len(OUTS)
    status = project.conveyor("status")
    assert status.returncode == 0, status.stderr
    rows = {line.split()[1]: line for line in status.stdout.splitlines() if line[:1] == "│"}
    for stage in STAGES:
        assert "out missing" not in rows[stage], status.stdout  # the out is right there
        assert "cache" in rows[stage], status.stdout
