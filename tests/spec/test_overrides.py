"""``-S key=value``: typed like the params file's value, checked before anything is written,
written keeping the file's comments, as ``dvc exp run -S`` writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conveyor.errors import UsageError
from conveyor.spec.overrides import parse_overrides, rendered, write_overrides

PARAMS = """\
# training knobs
train:
  eta: 0.1        # learning rate
  rounds: 100
  model: xgb
  early: true
  layers: [16, 8]
  seed: null
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "params.yaml").write_text(PARAMS)
    (tmp_path / "other.yaml").write_text("lr: 0.5\n")
    return tmp_path


def _parse(root: Path, *pairs: str) -> dict[str, object]:
    return {o.shown: o.new for o in parse_overrides(pairs, root, root / "params.yaml")}


def test_values_are_typed_like_the_values_they_replace(root: Path) -> None:
    assert _parse(root, "train.eta=0.3", "train.rounds=7", "train.model=123", "train.early=false",
                  "train.layers=[32, 16]", "train.seed=42", "other.yaml:lr=1") == {
        "train.eta": 0.3, "train.rounds": 7, "train.model": "123", "train.early": False,
        "train.layers": [32, 16], "train.seed": 42, "other.yaml:lr": 1.0}


@pytest.mark.parametrize(("pair", "message"), [
    ("train.rounds=many", "-S train.rounds=many: train.rounds is an integer in params.yaml (100); give an integer"),
    ("train.rounds=1.5", "train.rounds is an integer in params.yaml (100)"),
    ("train.early=3", "train.early is true or false in params.yaml (true)"),
    ("train.layers=5", "train.layers is a list in params.yaml ([16, 8])"),
    ("train.etta=0.3", "params.yaml has no key 'train.etta' (did you mean 'train.eta'?)"),
    ("train.eta", "write it as key=value"),
    ("missing.yaml:a=1", "params file"),
    ("../outside.yaml:a=1", "lies outside the project"),
])
def test_a_bad_override_is_a_usage_error_and_nothing_is_written(root: Path, pair: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_overrides(["train.eta=0.2", pair], root, root / "params.yaml")
    assert message in str(caught.value)
    assert (root / "params.yaml").read_text() == PARAMS


def test_every_problem_is_reported_at_once(root: Path) -> None:
    with pytest.raises(UsageError) as caught:
        parse_overrides(["train.etta=1", "train.rounds=x", "train.eta=1", "train.eta=2"], root, root / "params.yaml")
    text = str(caught.value)
    assert "train.etta" in text and "train.rounds=x" in text and "-S train.eta is given twice" in text


def test_writing_keeps_the_comments_and_the_other_keys(root: Path) -> None:
    write_overrides(parse_overrides(["train.eta=0.3", "train.model=mlp", "other.yaml:lr=2"], root,
                                    root / "params.yaml"))
    text = (root / "params.yaml").read_text()
    assert "# training knobs" in text and "# learning rate" in text
    assert yaml.safe_load(text) == {"train": {"eta": 0.3, "rounds": 100, "model": "mlp", "early": True,
                                              "layers": [16, 8], "seed": None}}
    assert yaml.safe_load((root / "other.yaml").read_text()) == {"lr": 2.0}


def test_a_list_keeps_its_flow_style_and_a_block_list_stays_a_block(root: Path) -> None:
    (root / "params.yaml").write_text("sweep:\n  alphas: [0.1, 10.0]  # the grid\n  depths:\n  - 2\n  - 4\n")
    changes = parse_overrides(["sweep.alphas=[0.1, 10.0, 100.0]", "sweep.depths=[2, 4, 8]"], root,
                              root / "params.yaml")
    texts = rendered(changes)
    assert (root / "params.yaml").read_text().startswith("sweep:\n  alphas: [0.1, 10.0]  #")  # nothing written yet
    assert texts[root / "params.yaml"] == (
        "sweep:\n  alphas: [0.1, 10.0, 100.0] # the grid\n  depths:\n  - 2\n  - 4\n  - 8\n")
