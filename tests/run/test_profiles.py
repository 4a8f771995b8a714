"""Compute profiles with real clusters: started lazily, shared, and gone after close.

Dask LocalClusters here are real (worker processes, spawned); "no worker left" is
checked on the process table with psutil, polling against a deadline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from conveyor.errors import ProfileError, UsageError
from conveyor.run.profiles import LOCAL, Profiles, deps_bytes, visible_gpus
from conveyor.spec.profiles import DaskCudaProfile, DaskProfile, Profile, SlurmProfile, ThreadsProfile

if TYPE_CHECKING:
    from conftest import ProjectDir

CPU = DaskProfile(kind="dask", n_workers=2, threads_per_worker=1, processes=True, memory_limit="1GiB")
IO = ThreadsProfile(kind="threads", max_workers=3)


def children() -> set[int]:
    """Direct children: where LocalCluster's worker processes live (a session-wide server's own
    helpers, in the full suite, are grandchildren and not this module's business)."""
    return {c.pid for c in psutil.Process().children(recursive=False)}


@pytest.fixture
def baseline() -> set[int]:
    """This process's children before the test (multiprocessing's resource tracker included).

    The tracker is started by the first spawned worker and lives as long as this process,
    by design; it is no worker, so it is made part of the baseline.
    """
    resource_tracker.ensure_running()
    return children()


def left_over(baseline: set[int], deadline_s: float = 10.0) -> set[int]:
    """Child processes that are not in ``baseline``, once they are gone or the deadline passed."""
    end = time.monotonic() + deadline_s
    while (extra := children() - baseline) and time.monotonic() < end:
        time.sleep(0.05)
    return extra


def conveyor_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"conveyor-{name}")]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# --- dask: a LocalCluster per run ---------------------------------------------------------


@pytest.mark.slow
def test_dask_profile_starts_on_first_get_is_shared_and_leaves_no_worker(baseline: set[int]) -> None:
    profiles = Profiles({"cpu": CPU, "io": IO})
    with profiles:
        assert profiles.check({"cpu", "io", None}) == []
        assert profiles.resolve("cpu") == "cpu"
        assert children() == baseline  # nothing started yet
        first = profiles.get("cpu")
        assert first.client is not None and first.executor is None
        assert (first.profile, first.n_workers, first.devices) == ("cpu", 2, ())
        assert len(children() - baseline) >= 2  # the worker processes
        assert first.client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
        second = profiles.get("cpu")
        assert second is first and second.client is first.client
        assert conveyor_threads("io") == []  # the other profile was never used
    assert left_over(baseline) == set()


@pytest.mark.slow
def test_concurrent_first_gets_start_one_cluster(baseline: set[int]) -> None:
    got = []
    with Profiles({"cpu": CPU}) as profiles:
        threads = [threading.Thread(target=lambda: got.append(profiles.get("cpu"))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(got) == 3 and got[0] is got[1] is got[2]
        assert len(children() - baseline) == 2
    assert left_over(baseline) == set()


@pytest.mark.slow
def test_no_worker_outlives_an_exception_in_the_run(baseline: set[int]) -> None:
    with pytest.raises(RuntimeError, match="stage failed"), Profiles({"cpu": CPU}) as profiles:
        assert profiles.get("cpu").client is not None
        raise RuntimeError("stage failed")
    assert left_over(baseline) == set()


def test_dask_profile_with_an_address_uses_that_cluster_and_leaves_it_running() -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp", host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster:
        remote = DaskProfile(kind="dask", address=cluster.scheduler_address)
        with Profiles({"remote": remote}) as profiles:
            resources = profiles.get("remote")
            assert resources.client is not None and resources.n_workers == 1
            assert resources.client.scheduler_info()["address"] == cluster.scheduler_address
            assert resources.client.submit(lambda x: x * 2, 21).result(timeout=30) == 42
        assert resources.client.status == "closed"
        with Client(cluster.scheduler_address, timeout="10s") as client:  # the cluster still serves
            assert client.submit(lambda x: x + 1, 1).result(timeout=30) == 2
            assert len(client.scheduler_info()["workers"]) == 1


# --- threads ------------------------------------------------------------------------------


def test_threads_profile_gives_a_pool_that_is_shut_down_on_close() -> None:
    profiles = Profiles({"io": IO})
    assert conveyor_threads("io") == []
    resources = profiles.get("io")
    assert resources.client is None and resources.n_workers == 3
    assert resources.executor is not None
    names = list(resources.executor.map(lambda _: threading.current_thread().name, range(6)))
    assert all(n.startswith("conveyor-io") for n in names)
    assert profiles.get("io") is resources
    profiles.close()
    assert conveyor_threads("io") == []
    with pytest.raises(RuntimeError, match="after shutdown"):
        resources.executor.submit(print)


def test_a_stage_without_on_runs_locally() -> None:
    with Profiles({"io": IO}) as profiles:
        assert profiles.resolve(None) is None
        assert profiles.get(None) is LOCAL
        assert LOCAL.client is None and LOCAL.executor is None


# --- in_process_below: small deps run in the runner's process --------------------------------


def sized(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * n)
    return path


def test_deps_under_in_process_below_run_in_process_and_start_no_cluster(tmp_path: Path, baseline: set[int]) -> None:
    small = DaskProfile(kind="dask", n_workers=2, in_process_below="1KiB")
    sized(tmp_path / "data/a/part-0", 300)
    sized(tmp_path / "data/a/sub/part-1", 300)
    sized(tmp_path / "data/b.csv", 1000)
    with Profiles({"cpu": small, "gpu": DaskCudaProfile(kind="dask-cuda", fallback="cpu")}) as profiles:
        placed = profiles.place("cpu", [tmp_path / "data/a"])
        assert placed.in_process
        assert placed.why == "in process: its deps hold 600 B, under the in_process_below of profile 'cpu' (1KiB)"
        resources = profiles.in_process("cpu")
        assert resources.profile == "cpu" and resources.client is None and resources.executor is None
        assert children() == baseline  # deciding starts nothing

        big = profiles.place("cpu", [tmp_path / "data/a", tmp_path / "data/b.csv"])
        assert not big.in_process
        assert big.why == "on the workers of profile 'cpu': its deps hold at least its in_process_below (1KiB)"
        if not visible_gpus():  # the gpu profile falls back to cpu, and so does its placement
            assert profiles.place("gpu", [tmp_path / "data/a"]).in_process


def test_a_slurm_profile_places_small_stages_in_process_without_submitting_a_job(tmp_path: Path) -> None:
    sized(tmp_path / "small", 10)
    hpc = SlurmProfile(kind="slurm", queue="gpu", in_process_below="1KiB")
    with Profiles({"hpc": hpc}) as profiles:  # deciding needs neither dask-jobqueue nor a Slurm
        placed = profiles.place("hpc", [tmp_path / "small"])
        assert placed.in_process and "in_process_below of profile 'hpc' (1KiB)" in placed.why
        assert profiles.in_process("hpc").client is None


def test_profiles_without_in_process_below_always_use_their_workers(tmp_path: Path) -> None:
    sized(tmp_path / "tiny", 1)
    with Profiles({"cpu": CPU, "io": IO}) as profiles:
        for name in ("cpu", "io", None):
            placed = profiles.place(name, [tmp_path / "tiny"])
            assert not placed.in_process and placed.why == ""


def test_deps_bytes_stops_counting_past_the_limit_and_skips_what_is_gone(tmp_path: Path) -> None:
    for i in range(50):
        sized(tmp_path / f"many/part-{i:02d}", 100)
    (tmp_path / "many/dangling").symlink_to(tmp_path / "nowhere")
    assert deps_bytes([tmp_path / "many"], stop_above=10**9) == 5000
    assert 250 < deps_bytes([tmp_path / "many"], stop_above=250) <= 300  # stopped at the third file
    assert deps_bytes([tmp_path / "missing"], stop_above=10) == 0


# --- dask-cuda without a GPU --------------------------------------------------------------


@pytest.mark.usefixtures("no_gpu")
def test_visible_gpus_honours_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_gpus() == ()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpus() == ()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == (0, 1)


@pytest.mark.usefixtures("no_gpu")
def test_gpu_profile_with_fallback_error_fails_before_anything_starts(baseline: set[int]) -> None:
    profiles = Profiles({"cpu": CPU, "gpu": DaskCudaProfile(kind="dask-cuda")})
    message = (r"^profile 'gpu' needs a GPU and none is visible; set 'fallback: cpu' or run with "
               r"--profile gpu=<cpu profile>$")
    with pytest.raises(ProfileError, match=message):
        profiles.resolve("gpu")
    with pytest.raises(ProfileError, match=message):
        profiles.check({"cpu", "gpu"})
    with pytest.raises(ProfileError, match=message):
        profiles.get("gpu")
    profiles.close()
    assert children() == baseline


@pytest.mark.usefixtures("no_gpu")
def test_gpu_profile_falls_back_to_the_profile_named_cpu() -> None:
    cpu = ThreadsProfile(kind="threads", max_workers=2)  # cheap to start; any kind may be 'cpu'
    with Profiles({"cpu": cpu, "gpu": DaskCudaProfile(kind="dask-cuda", fallback="cpu")}) as profiles:
        assert profiles.resolve("gpu") == "cpu"
        assert profiles.check({"gpu", "cpu", None}) == ["no GPU visible: profile 'gpu' falls back to 'cpu' (CPU)"]
        resources = profiles.get("gpu")
        assert resources.profile == "cpu" and resources.devices == ()
        assert profiles.get("cpu") is resources


@pytest.mark.usefixtures("no_gpu")
def test_gpu_profile_falls_back_to_a_named_profile() -> None:
    profiles: dict[str, Profile] = {"big": IO, "gpu": DaskCudaProfile(kind="dask-cuda", fallback="big")}
    with Profiles(profiles) as started:
        assert started.resolve("gpu") == "big"
        assert started.check({"gpu"}) == ["no GPU visible: profile 'gpu' falls back to 'big' (CPU)"]


@pytest.mark.slow
@pytest.mark.usefixtures("no_gpu")
def test_gpu_fallback_cpu_without_a_cpu_profile_starts_a_default_dask_cluster(baseline: set[int]) -> None:
    with Profiles({"gpu": DaskCudaProfile(kind="dask-cuda", fallback="cpu")}) as profiles:
        assert profiles.resolve("gpu") == "cpu"
        assert profiles.check({"gpu"}) == ["no GPU visible: profile 'gpu' falls back to 'cpu' (CPU)"]
        assert children() == baseline
        resources = profiles.get("gpu")
        assert resources.profile == "cpu" and resources.client is not None and resources.n_workers >= 1
        assert resources.client.submit(lambda: 7).result(timeout=30) == 7
    assert left_over(baseline) == set()


# --- --profile overrides --------------------------------------------------------------------


SET: dict[str, Profile] = {"io": IO, "cpu": CPU, "gpu": DaskCudaProfile(kind="dask-cuda")}


@pytest.mark.parametrize(("overrides", "unknown"), [({"gpu": "gpuu"}, "gpuu"), ({"remote": "cpu"}, "remote")])
def test_override_to_or_from_an_unknown_profile_is_a_usage_error(overrides: dict[str, str], unknown: str) -> None:
    ((old, new),) = overrides.items()
    with pytest.raises(UsageError, match=rf"^--profile {old}={new}: unknown profile '{unknown}' "
                                         r"\(profiles: io, cpu, gpu\)$"):
        Profiles(SET, overrides)


@pytest.mark.usefixtures("no_gpu")
def test_override_replaces_a_profile_before_the_gpu_check() -> None:
    profiles = Profiles(SET, {"gpu": "io"})
    assert profiles.resolve("gpu") == "io"
    assert profiles.check({"gpu"}) == []
    assert profiles.get("gpu") is profiles.get("io")
    profiles.close()


def test_conveyor_run_with_an_unknown_profile_override_exits_2(project: ProjectDir) -> None:
    project.good_spec()
    beside = Path(sys.executable).with_name("conveyor")
    conveyor = str(beside) if beside.exists() else (shutil.which("conveyor") or "conveyor")
    done = subprocess.run([conveyor, "run", "--dry-run", "--profile", "cpu=cpuu", "-c", "configs/pipeline.yaml"],
                          cwd=project.root, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "1000"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "--profile cpu=cpuu: unknown profile 'cpuu' (profiles: io, cpu, gpu)"


@pytest.fixture(autouse=True)
def _no_stray_threads() -> Iterator[None]:
    """A test that forgot to close its thread pool would leave conveyor-* threads behind."""
    yield
    assert [t.name for t in threading.enumerate() if t.name.startswith("conveyor-")] == []
