"""The model registry: the promotion rule, metrics files, atomic writes, champion copies.

Pure files, no Prefect: every case runs in ``tmp_path`` in milliseconds.
"""

from __future__ import annotations

import fcntl
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import RegistryError
from conveyor.models.registry import (
    Candidate,
    MetricRef,
    PromotionRule,
    Registry,
    Status,
    comparison_markdown,
    decide,
    load,
    locked,
    read_metrics,
    save,
    store_model,
)

AUC = MetricRef("metrics/test.json", "stack.auc")


def candidate(value: float | None, status: Status = "promoted", run_id: str = "r1", **extra: Any) -> Candidate:
    metrics = {"stack.auc": value} if value is not None else {}
    return Candidate(run_id=run_id, time="2026-01-05T03:00:00+00:00", status=status, reason="because",
                     metric=str(AUC), value=value, **{"metrics": metrics, **extra})


# ---------------------------------------------------------------- metric references and rules


def test_metric_ref_is_file_colon_dotted_key() -> None:
    assert MetricRef.parse("metrics/test.json:stack.auc") == AUC
    assert str(AUC) == "metrics/test.json:stack.auc"


@pytest.mark.parametrize("text", ["metrics/test.json", ":stack.auc", "metrics/test.json:", "m.json:.auc"])
def test_metric_ref_without_file_or_key_is_refused(text: str) -> None:
    with pytest.raises(RegistryError, match=r"write it as FILE:KEY, e\.g\. metrics/test\.json:stack\.auc"):
        MetricRef.parse(text)


def test_rule_refuses_unknown_direction_and_negative_margin() -> None:
    with pytest.raises(RegistryError, match=r"direction 'up': use max .* or min"):
        PromotionRule(AUC, "up", 0.0)  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match=r"min_delta -0.1: the margin is a number >= 0"):
        PromotionRule(AUC, "max", -0.1)
    with pytest.raises(RegistryError, match="min_delta nan"):
        PromotionRule(AUC, "max", math.nan)


# ---------------------------------------------------------------- the decision


@pytest.mark.parametrize(("direction", "min_delta", "challenger", "champion", "promote", "why"), [
    ("max", 0.01, 0.90, 0.85, True, r"better by 0\.05 \(min_delta 0\.01\)"),
    ("max", 0.02, 0.95, 0.93, True, r"better by 0\.02"),              # exactly the margin, despite float rounding
    ("max", 0.01, 0.855, 0.85, False, r"less than min_delta 0\.01"),
    ("max", 0.0, 0.85, 0.85, False, r"not better: stack\.auc 0\.85 vs champion 0\.85 \(max is better\)"),
    ("max", 0.0, 0.80, 0.85, False, r"not better"),
    ("min", 0.0, 0.10, 0.20, True, r"better by 0\.1 .*\(min is better\)"),
    ("min", 0.0, 0.30, 0.20, False, r"not better"),
])
def test_a_challenger_is_promoted_only_when_better_by_the_margin(
        direction: str, min_delta: float, challenger: float, champion: float, promote: bool, why: str) -> None:
    decision = decide(PromotionRule(AUC, direction, min_delta), challenger, candidate(champion))  # type: ignore[arg-type]
    assert decision.promote is promote
    assert re.search(why, decision.reason), decision.reason


def test_the_first_challenger_becomes_champion() -> None:
    decision = decide(PromotionRule(AUC), 0.7, None)
    assert decision.promote and "no champion yet" in decision.reason


def test_a_nan_challenger_is_never_promoted() -> None:
    assert not decide(PromotionRule(AUC), math.nan, None).promote


def test_champion_judged_on_another_key_of_the_same_file_is_compared_on_its_recorded_value() -> None:
    champion = Candidate(run_id="r0", time="t", status="promoted", reason="", metric=str(AUC), value=0.9,
                         metrics={"stack.auc": 0.9, "stack.loss": 0.30})
    loss = PromotionRule(MetricRef("metrics/test.json", "stack.loss"), "min", 0.0)
    assert decide(loss, 0.25, champion).promote
    assert not decide(loss, 0.35, champion).promote


def test_champion_without_a_value_for_the_metric_is_kept() -> None:
    other = PromotionRule(MetricRef("metrics/other.json", "auc"))
    decision = decide(other, 0.99, candidate(0.5))
    assert not decision.promote
    assert "no comparable metrics/other.json:auc (it was judged on metrics/test.json:stack.auc): kept" in \
        decision.reason
    assert not decide(PromotionRule(AUC), 0.99, candidate(math.nan)).promote  # NaN compares with nothing


# ---------------------------------------------------------------- metrics files


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_read_metrics_returns_the_value_and_every_number_flattened(tmp_path: Path) -> None:
    metrics = {"stack": {"auc": 0.91, "n": 3, "ok": True, "name": "x"}, "xgb": {"auc": 0.9}}
    write(tmp_path, AUC.path, json.dumps(metrics))
    value, numbers = read_metrics(tmp_path, AUC)
    assert value == 0.91
    assert numbers == {"stack.auc": 0.91, "stack.n": 3.0, "xgb.auc": 0.9}  # booleans and strings are not metrics


def test_read_metrics_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=r"metrics/test\.json not found: did the stage that writes it run\?"):
        read_metrics(tmp_path, AUC)


def test_read_metrics_suggests_the_key_meant(tmp_path: Path) -> None:
    write(tmp_path, AUC.path, json.dumps({"stack": {"auc": 0.91}}))
    with pytest.raises(RegistryError, match=r"has no number at 'stack\.acu' \(did you mean 'stack\.auc'\?\)"):
        read_metrics(tmp_path, MetricRef(AUC.path, "stack.acu"))
    with pytest.raises(RegistryError, match=r"has no number at 'zzz'; numbers in it: stack\.auc"):
        read_metrics(tmp_path, MetricRef(AUC.path, "zzz"))


def test_read_metrics_refuses_broken_json(tmp_path: Path) -> None:
    write(tmp_path, AUC.path, "{not json")
    with pytest.raises(RegistryError, match="is not readable JSON"):
        read_metrics(tmp_path, AUC)


# ---------------------------------------------------------------- the registry file


def test_history_grows_by_one_per_candidate_and_only_promotions_change_the_champion() -> None:
    book = Registry()
    first, worse, broken, better = (candidate(0.8, "promoted", "r1"), candidate(0.7, "rejected", "r2"),
                                    candidate(None, "failed", "r3"), candidate(0.9, "promoted", "r4"))
    book = book.add(first)
    assert (book.champion, len(book.history)) == (first, 1)
    book = book.add(worse).add(broken)
    assert (book.champion, len(book.history)) == (first, 3)
    book = book.add(better)
    assert book.champion == better
    assert [c.run_id for c in book.history] == ["r1", "r2", "r3", "r4"]


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "models" / "registry.json"
    book = Registry().add(candidate(0.8, data_version={"data/raw": "abc.dir"}, git_commit="f" * 40))
    save(path, book)
    assert load(path) == book
    assert json.loads(path.read_text())["champion"]["data_version"] == {"data/raw": "abc.dir"}


def test_a_missing_registry_is_empty(tmp_path: Path) -> None:
    assert load(tmp_path / "registry.json") == Registry()


def test_an_unreadable_registry_is_reported_and_left_alone(tmp_path: Path) -> None:
    path = write(tmp_path, "registry.json", "{broken")
    with pytest.raises(RegistryError, match=r"registry\.json is unreadable .* it was left as it is"):
        load(path)
    assert path.read_text() == "{broken"


def test_a_failed_save_leaves_the_previous_registry_whole(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    good = Registry().add(candidate(0.8))
    save(path, good)
    unserialisable = Registry().add(candidate(0.9, metrics={"x": object()}))
    with pytest.raises(TypeError):
        save(path, unserialisable)
    assert load(path) == good
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]  # no temporary left behind


def test_locked_excludes_a_second_writer(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    with locked(path), (tmp_path / ".registry.json.lock").open("a") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with (tmp_path / ".registry.json.lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit


# ---------------------------------------------------------------- champion copies and the report


def test_store_model_copies_a_file_or_a_directory_whole(tmp_path: Path) -> None:
    write(tmp_path, "models/stack.json", '{"w": 1}')
    write(tmp_path, "models/net/weights.bin", "0101")
    assert store_model(tmp_path, "models/stack.json", tmp_path / "models/champions/r1") == \
        "models/champions/r1/stack.json"
    assert store_model(tmp_path, "models/net", tmp_path / "models/champions/r1") == "models/champions/r1/net"
    assert (tmp_path / "models/champions/r1/stack.json").read_text() == '{"w": 1}'
    assert (tmp_path / "models/champions/r1/net/weights.bin").read_text() == "0101"
    assert sorted(p.name for p in (tmp_path / "models/champions/r1").iterdir()) == ["net", "stack.json"]


def test_store_model_names_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=r"model models/stack\.json not found"):
        store_model(tmp_path, "models/stack.json", tmp_path / "champions")


def test_comparison_markdown_shows_both_models_and_the_decision() -> None:
    champion = candidate(0.8, run_id="r1", model_md5="a" * 32, git_commit="b" * 40)
    challenger = candidate(0.75, status="rejected", run_id="r2", data_version={"data/raw": "c" * 32 + ".dir"})
    text = comparison_markdown("toy retraining", PromotionRule(AUC, "max", 0.01), champion, challenger)
    assert text.splitlines()[0] == "# toy retraining: champion kept"
    assert "| | run | metrics/test.json:stack.auc | status | data version | model md5 | git commit |" in text
    assert "| champion before | r1 | 0.8 | promoted |  | aaaaaaaaaaaa | bbbbbbbbbb |" in text
    assert "| challenger | r2 | 0.75 | rejected | data/raw cccccccccccc |" in text
    assert "**decision:** because" in text
    assert "rule: max metrics/test.json:stack.auc, min_delta 0.01" in text
    first = comparison_markdown("toy retraining", PromotionRule(AUC), None, candidate(0.8))
    assert "| champion before | (none) |" in first
