"""`conveyor predict` on a project whose model is a linear function (numpy only): a file bigger
than a swarm worker's memory limit is scored in partitions, in order, by workers that are gone
afterwards; workers too small to score a partition end the job with what to change (Dask
alone would wait forever); a file that does not match the model is refused before any worker starts.

(The reference pipeline's model, scored on an existing cluster and checked against evaluate,
is in test_existing_cluster.py.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_damage import damage_page
from projects import LINEAR_FEATURES as FEATURES
from projects import LINEAR_SPEC, LINEAR_TASKS, Project, linear_model
from projects import linear_scores as expected
from repos import git_dvc_init

from conveyor.errors import DamagedFileError
from conveyor.parquet import read_table


def write_rows(path: Path, rows: int, group: int = 250_000) -> None:
    """``rows`` rows of the model's features and a ``key`` column, in row groups of ``group``.

    Plain-encoded, as writers of float data often store it: a dictionary of 250,000 random doubles
    saves nothing and costs CPU (2M rows here: written in 1.7 CPU-s against 0.45 s plain, read in
    2.3 s against 0.1 s)."""
    rng = np.random.default_rng(7)
    schema = pa.schema([("key", pa.int64()), *((f, pa.float64()) for f in FEATURES)])
    with pq.ParquetWriter(path, schema, use_dictionary=False) as writer:
        for start in range(0, rows, group):
            chunk = {"key": np.arange(start, start + group) * 3, **{f: rng.standard_normal(group) for f in FEATURES}}
            writer.write_table(pa.table(chunk))


@pytest.mark.slow
def test_a_file_bigger_than_a_worker_is_scored_in_partitions_in_order(linear_project: Project) -> None:
    # a worker of this stack (dask, pandas, pyarrow) holds ~180 MiB before it reads anything and
    # ~370 MiB while it scores a 16 MiB partition: 640 MiB leaves it room below the 80 % pause
    rows = 10_000_000
    path = linear_project.root / "big.parquet"
    write_rows(path, rows)
    assert rows * (len(FEATURES) + 1) * 8 > 640 * 2**20  # more than one worker may hold

    scored = linear_project.conveyor("predict", "-i", "big.parquet", "-o", "scores.parquet", "--workers", "2",
                                     "--memory-limit", "640MiB", "--partition-size", "16MiB")
    assert scored.returncode == 0, scored.stdout + scored.stderr
    assert f"scored {rows:,} rows in" in scored.stdout and "on 2 workers" in scored.stdout
    assert "(latest run)" in scored.stdout  # no champion promoted: the project's own model files
    partitions = int(scored.stdout.split(" rows in ")[1].split()[0])
    assert partitions >= 8
    # no worker paused or restarted: Dask would have said so in the job's log (named on stderr)
    said = "".join(p.read_text() for p in linear_project.root.glob(".conveyor/predict/*.log")).lower()
    assert "restart" not in said and "killed" not in said and "pausing" not in said, said

    out = pq.ParquetFile(linear_project.root / "scores.parquet")
    assert out.schema_arrow.names == ["key", "score"] and out.metadata.num_rows == rows
    scores = out.read().to_pandas()
    start = 0  # every row in order, the source read a row group at a time (whole, it held 1.4 GB more)
    for batch in pq.ParquetFile(path).iter_batches(250_000):
        source, end = batch.to_pandas(), start + batch.num_rows
        assert (scores["key"].to_numpy()[start:end] == source["key"].to_numpy()).all()
        np.testing.assert_allclose(scores["score"].to_numpy()[start:end], expected(source), rtol=0, atol=1e-12)
        start = end
    assert start == rows
    assert not linear_project.left_running()
    assert not list(linear_project.root.glob(".scores.parquet*"))  # no staging file left


@pytest.mark.slow
def test_workers_too_small_for_a_partition_end_the_job_saying_so_instead_of_waiting_forever(
        linear_project: Project) -> None:
    write_rows(linear_project.root / "rows.parquet", 1_000_000)
    (linear_project.root / "scores.parquet").write_bytes(b"previous scores")

    # 160 MiB: less than a worker holds once it has imported its libraries and read a partition;
    # Dask pauses it, or restarts it again and again; without conveyor's watch, forever
    small = linear_project.conveyor("predict", "-i", "rows.parquet", "-o", "scores.parquet", "--workers", "2",
                                    "--memory-limit", "160MiB", "--partition-size", "16MiB", timeout=180)
    assert small.returncode == 1, small.stdout + small.stderr
    last = small.stderr.strip().splitlines()[-1]
    assert last.startswith("scoring partition ") and "160 MiB each" in last, small.stderr
    assert last.endswith("give the workers more memory (--memory-limit, or the profile's) or the partitions "
                          "less (--partition-size)"), last
    # Dask's own lines (workers paused, restarted) are in the job's log, named in one line, not on the terminal
    assert "distributed." not in small.stderr, small.stderr
    named = small.stderr.strip().splitlines()[-2]
    assert named.startswith("the job's log: .conveyor/predict/") and "from Dask and the scorer)" in named, small.stderr
    log = linear_project.root / named.split()[3]
    assert log.parent == linear_project.root / ".conveyor/predict" and "memory" in log.read_text()
    assert (linear_project.root / "scores.parquet").read_bytes() == b"previous scores"
    assert not list(linear_project.root.glob(".scores.parquet*"))
    assert not linear_project.left_running()


HELD_SCORER = LINEAR_TASKS + """

def predict(model, rows):  # the second file's rows (x0 == 1) are held until the job is interrupted
    import time
    while rows["x0"].iloc[0] == 1.0:
        time.sleep(0.05)
    return rows.to_numpy() @ np.asarray(model["weights"]) + model["bias"]
"""


@pytest.mark.slow
def test_ctrl_c_stops_a_job_and_leaves_the_previous_scores_as_they_were(linear_project: Project) -> None:
    linear_project.write("tasks/linear.py", HELD_SCORER)
    (linear_project.root / "in").mkdir()
    for n in (0, 1):  # two files, two partitions: the first scored (the staging file written), the second held
        frame = pd.DataFrame({f: np.full(1000, float(n)) for f in FEATURES}).assign(key=np.arange(1000) + 1000 * n)
        frame.to_parquet(linear_project.root / f"in/part-{n}.parquet")
    (linear_project.root / "scores.parquet").write_bytes(b"previous scores")

    # one worker with two threads: the held partition holds one, whichever Dask gives it first
    linear_project.write("configs/pipeline.yaml", LINEAR_SPEC.replace(
        "stages:", "profiles:\n  two: {kind: dask, n_workers: 1, threads_per_worker: 2}\nstages:", 1))
    job = linear_project.popen("predict", "-i", "in/*.parquet", "-o", "scores.parquet", "--profile", "two")
    try:
        deadline = time.monotonic() + 120
        while not list(linear_project.root.glob(".scores.parquet.conveyor-tmp-*")):
            assert job.poll() is None and time.monotonic() < deadline, "the job ended, or never scored the first file"
            time.sleep(0.05)
        job.send_signal(signal.SIGINT)
        screen = job.communicate(timeout=60)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, screen
    assert screen.strip().splitlines()[-1] == ("interrupted (SIGINT): scoring stopped, the workers started for it "
                                               "too; scores.parquet is as it was"), screen
    assert "Traceback" not in screen
    assert (linear_project.root / "scores.parquet").read_bytes() == b"previous scores"
    assert not list(linear_project.root.glob(".scores.parquet*"))
    assert not linear_project.left_running()


def test_an_input_that_does_not_match_the_model_is_refused_naming_the_columns(linear_project: Project) -> None:
    frame = pd.DataFrame({"key": [1, 2], **{f: [0.0, 1.0] for f in FEATURES}})
    frame.drop(columns=["x3", "x5"]).assign(label=[0, 1]).to_csv(linear_project.root / "rows.csv", index=False)
    (linear_project.root / "scores.parquet").write_bytes(b"previous scores")

    bad = linear_project.conveyor("predict", "-i", "rows.csv", "-o", "scores.parquet")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "missing the model's feature columns x3, x5" in bad.stderr
    assert "a column the model does not read: label (--allow-extra ignores them)" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert (linear_project.root / "scores.parquet").read_bytes() == b"previous scores"
    assert not linear_project.left_running()

    frame.to_csv(linear_project.root / "rows.csv", index=False)
    good = linear_project.conveyor("predict", "-i", "rows.csv", "-o", "scores.parquet", "--workers", "1")
    assert good.returncode == 0, good.stderr
    scores = pd.read_parquet(linear_project.root / "scores.parquet")
    assert scores["key"].tolist() == [1, 2]
    np.testing.assert_allclose(scores["score"], expected(frame), atol=1e-12)

    for args, message in [
        (("-i", "nothing-*.csv"), "--input nothing-*.csv: cannot read it as CSV (nothing-*.csv resolved to no files)"),
        (("-i", "missing.parquet"), "--input missing.parquet: no such file or directory; give a parquet or CSV"),
        (("-i", "rows.csv", "--id", "nope"), "no id column 'nope'"),
        (("-i", "rows.csv", "-m", "missing-dir"), "--model missing-dir: not a directory"),
        (("-i", "rows.csv", "--profile", "gpu"), "--profile gpu: unknown profile"),
    ]:
        refused = linear_project.conveyor("predict", *args, "-o", "scores.parquet")
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)


def test_an_input_with_a_damaged_page_fails_naming_the_file(linear_project: Project) -> None:
    """Scores are written with a CRC per page, and the input's pages are verified where a worker reads them."""
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({"key": np.arange(500), **{f: rng.standard_normal(500) for f in FEATURES}})
    rows = linear_project.root / "rows.parquet"
    frame.to_parquet(rows, index=False, write_page_checksum=True)
    scores = linear_project.root / "scores.parquet"

    good = linear_project.conveyor("predict", "-i", "rows.parquet", "-o", "scores.parquet", "--workers", "1")
    assert good.returncode == 0, good.stderr
    written = scores.read_bytes()
    copy = linear_project.root / "copy.parquet"
    copy.write_bytes(written)
    damage_page(copy)
    with pytest.raises(DamagedFileError):
        read_table(copy)

    damage_page(rows)
    bad = linear_project.conveyor("predict", "-i", "rows.parquet", "-o", "scores.parquet", "--workers", "1")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    last = bad.stderr.strip().splitlines()[-1]
    assert f"{rows} is damaged: a page fails its checksum (pyarrow: could not verify page integrity" in last, last
    assert last.endswith(": write it again"), last
    assert scores.read_bytes() == written  # the previous scores stay
    assert not list(linear_project.root.glob(".scores.parquet*"))
    assert not linear_project.left_running()


def test_a_dvc_yaml_project_declares_its_model_in_the_placement_spec(linear_project: Project) -> None:
    """A DVC project keeps its dvc.yaml; the spec that places its stages also says what its model is."""
    root = linear_project.root
    (root / "models/linear.json").unlink()
    (root / "configs/pipeline.yaml").unlink()
    linear_project.write("fit.py", f"import json, pathlib\npathlib.Path('models').mkdir(exist_ok=True)\n"
                                   f"pathlib.Path('models/linear.json').write_text({linear_model()!r})\n")
    linear_project.write("dvc.yaml", "stages:\n  fit:\n    cmd: python fit.py\n    deps: [fit.py]\n"
                                     "    outs: [models/linear.json]\n")
    placed = ("dvc: ../dvc.yaml\nmodel:\n  files: {weights: models/linear.json}\n"
              "  features: models/linear.json:features\n  load: tasks.linear:load\n  predict: tasks.linear:predict\n")
    linear_project.write("configs/placed.yaml", placed)
    git_dvc_init(root)
    ran = linear_project.conveyor("run", "-c", "configs/placed.yaml")
    assert ran.returncode == 0, ran.stdout + ran.stderr

    frame = pd.DataFrame({f: [0.0, 1.0, -2.0] for f in FEATURES})
    frame.to_parquet(root / "rows.parquet")
    scored = linear_project.conveyor("predict", "-c", "configs/placed.yaml", "-i", "rows.parquet",
                                     "-o", "scores.parquet", "--workers", "1")
    assert scored.returncode == 0, scored.stderr
    scores = pd.read_parquet(root / "scores.parquet")
    assert scores["row"].tolist() == [0, 1, 2]
    np.testing.assert_allclose(scores["score"], expected(frame), atol=1e-12)

    linear_project.write("configs/placed.yaml", placed.replace("{weights: models/linear.json}",
                                                               "{weights: models/linear.json, extra: model.pkl}"))
    bad = linear_project.conveyor("predict", "-c", "configs/placed.yaml", "-i", "rows.parquet", "-o", "s.parquet")
    assert bad.returncode == 2, bad.stderr
    assert "placed.yaml:3 model.files.extra: 'model.pkl' is not written by any stage of dvc.yaml" in bad.stderr
