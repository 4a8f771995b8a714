"""The outs journal on a real filesystem: previous outs kept aside, put back on failure and after kill -9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from subprocs import holding

from conveyor.run.journal import Journal


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the project (not conveyor's own state) with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".conveyor" not in p.relative_to(root).parts}


def entries(root: Path) -> list[str]:
    folder = root / ".conveyor" / "journal"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


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


def write_in_place(root: Path) -> None:
    """What a script does: write its outs where they are declared."""
    (root / "models/a.json").write_text('{"new": 2}')
    (root / "metrics/b.json").write_text('{"auc": 0.9}')
    (root / "data/raw").mkdir(parents=True, exist_ok=True)
    (root / "data/raw/part-9.csv").write_text("new9\n")


def test_the_stage_writes_into_empty_places_and_its_outs_stay(tmp_path: Path, previous: dict[str, bytes]) -> None:
    with Journal(tmp_path).protect("train", DECLARED):
        assert not any((tmp_path / p).exists() for p in DECLARED)  # as under dvc repro
        assert (tmp_path / "models").is_dir() and (tmp_path / "data").is_dir()  # parents stay
        write_in_place(tmp_path)
    assert snapshot(tmp_path) == {
        "models/a.json": b'{"new": 2}', "metrics/b.json": b'{"auc": 0.9}', "data/raw/part-9.csv": b"new9\n"}
    assert entries(tmp_path) == []


def test_a_directory_out_is_replaced_whole(tmp_path: Path, previous: dict[str, bytes]) -> None:
    """part-0 and part-1 of the old directory do not survive next to the new part-9."""
    with Journal(tmp_path).protect("ingest", ["data/raw"]):
        (tmp_path / "data/raw/nested").mkdir(parents=True)
        (tmp_path / "data/raw/nested/part-9.csv").write_text("new9\n")
    assert sorted(p.name for p in (tmp_path / "data/raw").rglob("*")) == ["nested", "part-9.csv"]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt(), TimeoutError("timed out")])
def test_a_failure_puts_the_previous_outs_back(tmp_path: Path, previous: dict[str, bytes],
                                               error: BaseException) -> None:
    with pytest.raises(type(error)), Journal(tmp_path).protect("train", DECLARED):
        write_in_place(tmp_path)
        raise error
    assert snapshot(tmp_path) == previous
    assert entries(tmp_path) == []


def test_an_out_that_did_not_exist_before_is_removed_on_failure(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), Journal(tmp_path).protect("train", ["models/new.json", "data/new"]):
        assert (tmp_path / "models").is_dir()  # parents of the outs are made for the stage
        (tmp_path / "models/new.json").write_text("partial")
        (tmp_path / "data/new").mkdir()
        (tmp_path / "data/new/half.csv").write_text("half")
        raise RuntimeError("died after a partial write")
    assert snapshot(tmp_path) == {}


def test_a_persist_out_stays_in_place_and_is_restored_on_failure(tmp_path: Path, previous: dict[str, bytes]) -> None:
    with pytest.raises(RuntimeError), Journal(tmp_path).protect("train", DECLARED, persist={"data/raw"}):
        assert (tmp_path / "data/raw/part-0.csv").read_text() == "old0\n"  # still there to continue from
        assert not (tmp_path / "models/a.json").exists()
        (tmp_path / "data/raw/part-0.csv").write_text("changed in place\n")
        (tmp_path / "data/raw/part-2.csv").write_text("appended\n")
        raise RuntimeError("boom")
    assert snapshot(tmp_path) == previous


def test_a_persist_out_keeps_what_a_successful_stage_wrote(tmp_path: Path, previous: dict[str, bytes]) -> None:
    with Journal(tmp_path).protect("train", ["data/raw"], persist={"data/raw"}):
        (tmp_path / "data/raw/part-2.csv").write_text("appended\n")
    assert sorted(p.name for p in (tmp_path / "data/raw").iterdir()) == ["part-0.csv", "part-1.csv", "part-2.csv"]


KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from conveyor.run.journal import Journal
root = Path(sys.argv[1])
with Journal(root).protect("train", {declared!r}, persist={persist!r}):
    (root / "models/a.json").write_text("partial")
    (root / "data/raw").mkdir(parents=True, exist_ok=True)
    (root / "data/raw/half.csv").write_text("half")
    (root / "models/extra.json").write_text("new out, half written")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def kill_mid_write(root: Path, declared: list[str], persist: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    script = KILLED_MID_WRITE.format(declared=declared, persist=set(persist))
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr


def test_after_kill_9_the_next_recovery_puts_the_previous_outs_back(tmp_path: Path,
                                                                   previous: dict[str, bytes]) -> None:
    kill_mid_write(tmp_path, [*DECLARED, "models/extra.json"])
    assert snapshot(tmp_path) != previous  # the half-written outs are what the project holds now
    assert len(entries(tmp_path)) == 1

    assert Journal(tmp_path).recover().restored == ["train"]
    assert snapshot(tmp_path) == previous  # models/extra.json did not exist before: gone
    assert entries(tmp_path) == []
    assert Journal(tmp_path).recover().restored == []


def test_after_kill_9_a_persist_out_is_restored_too(tmp_path: Path, previous: dict[str, bytes]) -> None:
    kill_mid_write(tmp_path, [*DECLARED, "models/extra.json"], persist={"data/raw"})
    assert (tmp_path / "data/raw/half.csv").exists()
    assert Journal(tmp_path).recover().restored == ["train"]
    assert snapshot(tmp_path) == previous


def test_recovery_leaves_a_stage_that_is_still_running_alone(tmp_path: Path, previous: dict[str, bytes]) -> None:
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from conveyor.run.journal import Journal
        root = Path(sys.argv[1])
        with Journal(root).protect("train", ["models/a.json"]):
            (root / "models/a.json").write_text("in progress")
            print("writing", flush=True)
            sys.stdin.readline()
    """)
    with holding(script, str(tmp_path), ready="writing"):
        assert Journal(tmp_path).recover().restored == []  # another process holds it: not abandoned
        assert (tmp_path / "models/a.json").read_text() == "in progress"
    assert (tmp_path / "models/a.json").read_text() == "in progress"  # it succeeded
    assert entries(tmp_path) == []


def test_recovery_after_a_kill_between_two_moves(tmp_path: Path, previous: dict[str, bytes]) -> None:
    """The manifest is written before anything moves: an out that was not moved yet stays as it is."""
    folder = tmp_path / ".conveyor/journal/train-0000"
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    os.replace(tmp_path / "models/a.json", folder / "0")  # out 0 moved, out 1 (metrics/b.json) not yet
    (tmp_path / "models/a.json").write_text("the stage never started; nothing should be here")
    manifest = {"stage": "train", "pid": 1, "outs": [
        {"path": "models/a.json", "existed": True, "persist": False, "slot": "0"},
        {"path": "metrics/b.json", "existed": True, "persist": False, "slot": "1"},
        {"path": "data/new", "existed": False, "persist": False, "slot": "2"}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert Journal(tmp_path).recover().restored == ["train"]
    assert snapshot(tmp_path) == previous


def test_stages_running_at_once_keep_their_own_outs(tmp_path: Path, previous: dict[str, bytes]) -> None:
    """Two stages in two threads, one fails, one succeeds: each journal entry minds its own outs."""
    start = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def stage(name: str, outs: list[str], fail: bool) -> None:
        try:
            with Journal(tmp_path).protect(name, outs):
                start.wait()
                for out in outs:
                    (tmp_path / out).write_text(f"{name} new")
                if fail:
                    raise RuntimeError(name)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=("a", ["models/a.json"], False)),
               threading.Thread(target=stage, args=("b", ["metrics/b.json"], True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [str(e) for e in errors] == ["b"]
    assert (tmp_path / "models/a.json").read_text() == "a new"
    assert (tmp_path / "metrics/b.json").read_text() == '{"auc": 0.5}'
    assert entries(tmp_path) == []


def test_an_out_on_another_file_system_is_copied_aside(tmp_path: Path) -> None:
    """/dev/shm is a tmpfs: a rename into the journal fails with EXDEV, a copy takes its place."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system to put an out on")
    elsewhere = shm / f"conveyor-test-{os.getpid()}"
    elsewhere.mkdir()
    try:
        (elsewhere / "model.bin").write_bytes(b"old model")
        (tmp_path / "models").symlink_to(elsewhere)
        with pytest.raises(RuntimeError), Journal(tmp_path).protect("train", ["models/model.bin"]):
            assert not (elsewhere / "model.bin").exists()
            (tmp_path / "models/model.bin").write_bytes(b"partial")
            raise RuntimeError("boom")
        assert (elsewhere / "model.bin").read_bytes() == b"old model"
    finally:
        import shutil

        shutil.rmtree(elsewhere)
