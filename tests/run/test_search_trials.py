"""A trial's folder: the project seen through symlinks, except what the trial writes; and the
trials of a search ranked in `compare` by its objective."""

from __future__ import annotations

from pathlib import Path

from conveyor.run.compare import rows_of
from conveyor.run.record import RunRecord, StageRecord
from conveyor.run.trials import overlay, unlink


def test_a_trial_sees_the_project_but_writes_its_outs_and_params_in_its_own_folder(tmp_path: Path) -> None:
    root, folder = tmp_path / "proj", tmp_path / "trial-0"
    for rel, text in {"data/features/part.parquet": "x", "models/scaler.json": "s", "models/model.json": "old",
                      "params.yaml": "a: 1\n", "scripts/train.py": "", "dvc.yaml": "", "dvc.lock": "",
                      "data.dvc": "", ".dvc/config": "", ".git/HEAD": "", ".conveyor/runs/x.json": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)

    links = overlay(root, folder, ["models/model.json", "metrics/train.json", "params.yaml"])

    assert sorted(p.relative_to(folder).as_posix() for p in links) == [
        "data", "models/scaler.json", "scripts"]  # no dvc.yaml, dvc.lock, .dvc, .git, .conveyor, *.dvc
    assert (folder / "data/features/part.parquet").read_text() == "x"
    assert not (folder / "models/model.json").exists() and not (folder / "params.yaml").exists()
    (folder / "models/model.json").write_text("trial's")
    (folder / "metrics").mkdir()
    (folder / "metrics/train.json").write_text("{}")

    unlink(folder, links)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == [
        "metrics", "metrics/train.json", "models", "models/model.json"]
    assert (root / "models/model.json").read_text() == "old" and (root / "data/features/part.parquet").exists()


def test_compare_ranks_a_searchs_trials_by_its_objective_and_a_matrix_as_it_ran() -> None:
    def trial(rmse: float | None) -> StageRecord:
        return StageRecord(status="succeeded" if rmse is not None else "failed", item={"train.alpha": 1.0},
                           metrics={"rmse": rmse} if rmse is not None else {})

    values = {"train@trial-0": 0.3, "train@trial-1": None, "train@trial-2": 0.1, "train@trial-3": 0.2}
    search = RunRecord("s", "p", stages={n: trial(v) for n, v in values.items()},
                       search={"metric": "train:rmse", "minimize": True})
    assert [r.item for r in rows_of([search])] == ["train@trial-2", "train@trial-3", "train@trial-0", "train@trial-1"]
    search.search = {"metric": "train:rmse", "minimize": False}
    assert [r.item for r in rows_of([search])] == ["train@trial-0", "train@trial-3", "train@trial-2", "train@trial-1"]
    matrix = RunRecord("m", "p", stages={n: trial(v) for n, v in values.items()})
    assert [r.item for r in rows_of([matrix])] == list(values)  # a matrix's items: as they ran
