"""Atomic outs (all appear, or none) and the project's run lock, on a real filesystem."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.errors import MissingOutputError, RunLockedError
from conveyor.run.outs import TMP_MARK, run_lock, staged_outs


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones included) with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(f"*{TMP_MARK}*"))


@pytest.fixture
def previous(tmp_path: Path) -> dict[str, bytes]:
    """Outs of an earlier successful run: a file, a nested file and a directory."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.json").write_bytes(b'{"old": 1}\x00\xff')
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "b.json").write_text('{"auc": 0.5}')
    (tmp_path / "data" / "raw").mkdir(parents=True)
    (tmp_path / "data" / "raw" / "part-0.csv").write_text("old0\n")
    (tmp_path / "data" / "raw" / "part-1.csv").write_text("old1\n")
    return snapshot(tmp_path)


DECLARED = ["models/a.json", "metrics/b.json", "data/raw"]


def write_all(staging: dict[str, Path]) -> None:
    staging["models/a.json"].write_text('{"new": 2}')
    staging["metrics/b.json"].write_text('{"auc": 0.9}')
    staging["data/raw"].mkdir()
    (staging["data/raw"] / "part-9.csv").write_text("new9\n")


def test_outs_appear_only_after_the_body_succeeds(tmp_path: Path) -> None:
    with staged_outs(tmp_path, "train", ["models/sub/m.json", "data/out"]) as staging:
        tmp = staging["models/sub/m.json"]
        assert tmp.parent == tmp_path / "models" / "sub"  # a sibling: the rename stays on one filesystem
        assert tmp.name.startswith(TMP_MARK) and tmp.name.endswith("-m.json")  # keeps the extension
        tmp.write_text("model")
        staging["data/out"].mkdir()
        (staging["data/out"] / "x").write_text("x")
        assert not (tmp_path / "models/sub/m.json").exists()
        assert not (tmp_path / "data/out").exists()
    assert snapshot(tmp_path) == {"models/sub/m.json": b"model", "data/out/x": b"x"}


def test_new_outs_replace_the_previous_ones(tmp_path: Path, previous: dict[str, bytes]) -> None:
    with staged_outs(tmp_path, "train", DECLARED) as staging:
        write_all(staging)
    assert snapshot(tmp_path) == {
        "models/a.json": b'{"new": 2}', "metrics/b.json": b'{"auc": 0.9}', "data/raw/part-9.csv": b"new9\n"}


def test_a_directory_out_replaces_the_whole_directory(tmp_path: Path, previous: dict[str, bytes]) -> None:
    """part-0 and part-1 of the old directory do not survive next to the new part-9."""
    with staged_outs(tmp_path, "ingest", ["data/raw"]) as staging:
        (staging["data/raw"] / "nested").mkdir(parents=True)
        (staging["data/raw"] / "nested" / "part-9.csv").write_text("new9\n")
    assert sorted(p.name for p in (tmp_path / "data/raw").rglob("*")) == ["nested", "part-9.csv"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failing_body_leaves_the_previous_outs_intact(tmp_path: Path, previous: dict[str, bytes],
                                                        error: BaseException) -> None:
    with pytest.raises(type(error)), staged_outs(tmp_path, "train", DECLARED) as staging:
        write_all(staging)
        raise error
    assert snapshot(tmp_path) == previous
    assert leftovers(tmp_path) == []


def test_a_forgotten_out_raises_and_replaces_nothing(tmp_path: Path, previous: dict[str, bytes]) -> None:
    with pytest.raises(MissingOutputError, match=r"^stage 'train' failed: did not write metrics/b\.json$") as info, \
            staged_outs(tmp_path, "train", DECLARED) as staging:
        staging["models/a.json"].write_text('{"new": 2}')
        staging["data/raw"].mkdir()
    assert (info.value.stage, info.value.reason) == ("train", "did not write metrics/b.json")
    assert snapshot(tmp_path) == previous
    assert leftovers(tmp_path) == []


def test_every_forgotten_out_is_named(tmp_path: Path) -> None:
    with pytest.raises(MissingOutputError, match=r"did not write models/a\.json, data/raw$"), \
            staged_outs(tmp_path, "train", DECLARED) as staging:
        staging["metrics/b.json"].write_text("{}")
    assert snapshot(tmp_path) == {}


def test_leftovers_of_a_killed_attempt_are_cleaned_on_the_next_run(tmp_path: Path,
                                                                   previous: dict[str, bytes]) -> None:
    """A stage process killed mid-write (SIGKILL: no finally runs) leaves its temporaries."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from conveyor.run.outs import staged_outs
        with staged_outs(Path({str(tmp_path)!r}), "train", {DECLARED!r}) as staging:
            staging["models/a.json"].write_text("partial")
            staging["data/raw"].mkdir()
            (staging["data/raw"] / "half.csv").write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    stray = leftovers(tmp_path)
    assert {Path(s).parent.as_posix() for s in stray} >= {"models", "data"}
    assert {k: v for k, v in snapshot(tmp_path).items() if TMP_MARK not in k} == previous

    with staged_outs(tmp_path, "train", DECLARED) as staging:
        assert leftovers(tmp_path) == []  # cleaned before the body starts
        write_all(staging)
    assert leftovers(tmp_path) == []
    assert snapshot(tmp_path)["models/a.json"] == b'{"new": 2}'


def test_leftovers_are_cleaned_even_when_the_next_attempt_fails(tmp_path: Path, previous: dict[str, bytes]) -> None:
    (tmp_path / "models" / f"{TMP_MARK}1234-deadbeef-a.json").write_text("stray")
    (tmp_path / "data" / f"{TMP_MARK}old-cafe-raw").mkdir()
    (tmp_path / "models" / ".a.json.keep").write_text("not ours")
    with pytest.raises(RuntimeError), staged_outs(tmp_path, "train", DECLARED):
        raise RuntimeError("boom")
    assert leftovers(tmp_path) == []
    assert (tmp_path / "models" / ".a.json.keep").read_text() == "not ours"


# --- the run lock -------------------------------------------------------------------------

TAKE_LOCK = """
import sys, time
from pathlib import Path
from conveyor.errors import RunLockedError
from conveyor.run.outs import run_lock
start = time.perf_counter()
try:
    with run_lock(Path(sys.argv[1])):
        print("locked", flush=True)
        sys.stdin.readline()
except RunLockedError as exc:
    print(f"{time.perf_counter() - start:.3f} {exc}")
    sys.exit(3)
"""


def take_lock(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TAKE_LOCK, str(root)], input="\n", capture_output=True,
                          text=True, timeout=60)


def test_a_second_run_in_another_process_fails_at_once(tmp_path: Path) -> None:
    lock = tmp_path / ".conveyor" / "run.lock"
    with run_lock(tmp_path):
        done = take_lock(tmp_path)
        assert lock.read_text() == str(os.getpid())
    assert done.returncode == 3, done.stderr
    elapsed, _, message = done.stdout.strip().partition(" ")
    assert float(elapsed) < 1.0
    assert message == (f"another conveyor run holds {lock} (pid {os.getpid()}); wait for it to finish, "
                       "then run again")


def test_this_process_fails_at_once_while_another_holds_the_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", TAKE_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        with pytest.raises(RunLockedError, match=rf"holds {tmp_path / '.conveyor' / 'run.lock'} "
                                                 rf"\(pid {holder.pid}\)"), run_lock(tmp_path):
            pass
        assert time.perf_counter() - start < 1.0
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    with run_lock(tmp_path):  # released when the holder finished
        pass


def test_the_lock_is_released_after_a_run_and_after_a_failure(tmp_path: Path) -> None:
    with run_lock(tmp_path):
        pass
    assert take_lock(tmp_path).returncode == 0
    with pytest.raises(RuntimeError), run_lock(tmp_path):
        raise RuntimeError("stage failed")
    assert take_lock(tmp_path).returncode == 0
    assert (tmp_path / ".conveyor" / "run.lock").read_text() == ""
