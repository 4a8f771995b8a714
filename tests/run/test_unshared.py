"""The pieces of a stage on a worker without the project's disk, with no cluster of their own: the
data's round trip through a local-directory DVC remote (the real `dvc` CLI makes the repository),
the scratch directory, and the paths moved into it. The whole is tested in
tests/e2e/test_unshared_disk.py."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
from repos import dvc

from conveyor.dvc.remote import default_remote, materialise, push
from conveyor.errors import RemoteDataError
from conveyor.run.commands import Command
from conveyor.run.unshared import SCRATCH_PREFIX, Shipment, command_in_scratch, run_in_scratch


def _repo(root: Path, store: Path, *config: str) -> None:
    root.mkdir()
    extra = [["config", *config]] if config else []
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, capture_output=True)
    for argv in (["init", "-q"], ["config", "core.analytics", "false"], ["remote", "add", "-d", "store", str(store)],
                 *extra):
        done = dvc(root, *argv)
        assert done.returncode == 0, done.stdout + done.stderr


def test_no_dvc_repository_or_no_default_remote_has_no_store(tmp_path: Path) -> None:
    assert default_remote(tmp_path) is None
    (tmp_path / "repo").mkdir()
    subprocess.run(["git", "init", "-q"], cwd=tmp_path / "repo", check=True)
    assert dvc(tmp_path / "repo", "init", "-q").returncode == 0
    assert default_remote(tmp_path / "repo") is None


def test_files_and_directories_go_through_the_remote_by_dvcs_hashes(tmp_path: Path) -> None:
    root, store = tmp_path / "repo", tmp_path / "store"
    _repo(root, store)
    (root / "data/d/sub").mkdir(parents=True)
    (root / "data/d/a.txt").write_text("a\n")
    (root / "data/d/sub/b.txt").write_text("b\n")
    (root / "data/f.txt").write_text("hello\n")
    remote = default_remote(root)
    assert remote is not None and remote.name == "store"

    hashes = push(remote, root, ["data/d", "data/f.txt", "data/missing"])
    assert hashes["data/f.txt"] == "b1946ac92492d2347c6235b4d2611184"  # md5 of "hello\n", as dvc add has it
    assert hashes["data/d"].endswith(".dir") and "data/missing" not in hashes
    assert (store / "files/md5/b1/946ac92492d2347c6235b4d2611184").read_text() == "hello\n"

    # what `dvc add` would record for the directory is the same hash
    assert dvc(root, "add", "-q", "data/d").returncode == 0
    assert hashes["data/d"] in (root / "data/d.dvc").read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").mkdir()
    (elsewhere / "data/f.txt").write_text("an older version\n")
    materialise(remote, elsewhere, hashes)
    assert (elsewhere / "data/f.txt").read_text() == "hello\n"
    assert (elsewhere / "data/d/sub/b.txt").read_text() == "b\n"
    assert sorted(p.name for p in (elsewhere / "data").iterdir()) == ["d", "f.txt"]  # no draft left


def test_a_remote_out_of_reach_says_what_to_configure_and_the_error_travels_back_from_a_worker(
        tmp_path: Path) -> None:
    root = tmp_path / "repo"
    _repo(root, tmp_path / "store")
    (root / "f.txt").write_text("hello\n")
    remote = default_remote(root)
    assert remote is not None
    hashes = push(remote, root, ["f.txt"])
    (tmp_path / "store").rename(tmp_path / "moved")  # as a worker that does not mount it sees it
    with pytest.raises(RemoteDataError) as caught:
        materialise(remote, tmp_path / "elsewhere", hashes)
    expected = (f"checking f.txt out of DVC remote 'store' ({tmp_path / 'store'}) failed: CheckoutError: "
                "Checkout failed; the runner and the workers both need to reach it")
    assert str(caught.value).startswith(expected)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)
    assert not (tmp_path / "elsewhere/f.txt").exists()


def test_a_scratch_directory_gets_the_deps_and_is_gone_even_when_the_stage_raises(tmp_path: Path) -> None:
    root, store = tmp_path / "repo", tmp_path / "store"
    _repo(root, store, "cache.type", "hardlink")
    (root / "in.txt").write_text("21\n")
    remote = default_remote(root)
    assert remote is not None and remote.links == ("hardlink",)
    shipment = Shipment(remote, str(root), push(remote, root, ["in.txt"]), ("out/twice.txt",))
    seen: list[Path] = []

    def stage(scratch: Path) -> None:
        seen.append(scratch)
        assert scratch.name.startswith(SCRATCH_PREFIX)
        assert os.stat(scratch / "in.txt").st_nlink == 2  # linked to the remote's object, as cache.type says
        (scratch / "out").mkdir()
        (scratch / "out/twice.txt").write_text(str(2 * int((scratch / "in.txt").read_text())))

    said: list[str] = []
    _, outs = run_in_scratch(shipment, stage, said.append)
    assert said[0].startswith("deps checked out into ") and said[1].startswith("outs stored in the remote")
    assert not seen[-1].exists()
    materialise(remote, root, outs)
    assert (root / "out/twice.txt").read_text() == "42"

    def broken(scratch: Path) -> None:
        seen.append(scratch)
        raise RuntimeError("the stage broke")

    with pytest.raises(RuntimeError, match="the stage broke"):
        run_in_scratch(shipment, broken, said.append)
    assert not seen[-1].exists()


def test_a_command_runs_in_the_scratch_directory_with_the_variables_that_name_the_project(tmp_path: Path) -> None:
    root = "/home/me/proj"
    remote = default_remote(tmp_path)  # None: only the paths matter here
    shipment = Shipment(remote, root, {}, ())  # type: ignore[arg-type]
    command = Command("s", ("python x.py",), cwd=f"{root}/sub", env={"DVC_ROOT": root, "OTHER": "/home/me/projects",
                                                                       "CKPT": f"{root}/.conveyor/ck"})
    moved = command_in_scratch(command, shipment, Path("/scratch/x"))
    assert moved.cwd == "/scratch/x/sub"
    assert moved.env == {"DVC_ROOT": "/scratch/x", "OTHER": "/home/me/projects", "CKPT": "/scratch/x/.conveyor/ck"}
