"""``conveyor runs`` and ``conveyor compare`` over run records written by hand (no pipeline runs).

Tables are read back line by line: a run's line is its cells split on whitespace, so each
test pins the values each run (or matrix item) shows, in the column order.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from browser import CHROMIUM, browse
from rich.console import Console
from typer.testing import CliRunner, Result

import conveyor.cli.app as cli
from conveyor.cli.chart import chart_page
from conveyor.cli.history import compare_table
from conveyor.errors import UsageError
from conveyor.run.compare import artifact_rows, rows_of
from conveyor.run.record import RunRecord, StageRecord, parse_record

if TYPE_CHECKING:
    from conftest import ProjectDir

SPEC = """\
pipeline: demo
stages:
  prepare: {cmd: "echo > data.txt", params: [preprocess], outs: [data.txt]}
  train: {cmd: "echo > model.txt", deps: [data.txt], params: [train], outs: [model.txt], metrics: [m.json]}
"""
REPO = Path(__file__).resolve().parents[2]
RUNS = ".conveyor/runs"


@pytest.fixture
def demo(project: ProjectDir, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project whose spec loads; commands run in it, printing 200 columns wide, no colour."""
    project.spec(SPEC)
    project.spec(SPEC.replace("demo", "other"), "configs/other.yaml")
    monkeypatch.chdir(project.root)
    monkeypatch.setattr(cli, "out", Console(width=200, color_system=None))
    monkeypatch.setattr(cli, "err", Console(width=200, color_system=None, stderr=True))
    yield project.root


def write_run(root: Path, run_id: str, minute: int, *, spec: str = "configs/pipeline.yaml",
              params: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
              stages: dict[str, StageRecord] | None = None, status: str = "succeeded") -> RunRecord:
    run = RunRecord(run_id, "demo", status=status, started=f"2026-11-24T10:{minute:02d}:00+00:00",
                    wall_s=2.5, spec=spec, overrides=overrides or {}, params=params or {},
                    stages=stages or {"train": StageRecord("succeeded", metrics={"acc": 0.9})})
    path = root / RUNS / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.to_dict()))
    return run


def conveyor(*args: str) -> Result:
    return CliRunner().invoke(cli.app, list(args))


def lines_of(output: str, first: str) -> list[list[str]]:
    """The lines of ``output`` whose first cell is ``first``, split into cells."""
    return [line.split() for line in output.splitlines() if line.split()[:1] == [first]]


# ------------------------------------------------------------------- conveyor runs

def test_runs_lists_this_specs_runs_newest_first(demo: Path) -> None:
    old = {"run_id": "r1-old", "pipeline": "demo", "status": "succeeded", "started": "2026-11-24T09:00:00+00:00",
           "wall_s": 1.0, "stages": {"train": {"status": "succeeded", "duration_s": 1.0}},
           "from_a_newer_conveyor": True}  # no spec, params, overrides, metrics, item: recorded before them
    (demo / RUNS).mkdir(parents=True)
    (demo / RUNS / "r1-old.json").write_text(json.dumps(old))
    failed = {"prepare": StageRecord("skipped"), "train": StageRecord("failed")}
    write_run(demo, "r2-eta", 5, overrides={"train.xgb.eta": 0.3}, stages=failed, status="failed")
    write_run(demo, "r3-other", 7, spec="configs/other.yaml")
    newest = write_run(demo, "r4-new", 9)
    (demo / RUNS / "latest.json").write_text(json.dumps(newest.to_dict()))
    (demo / RUNS / "r4-new.events").write_text('{"stage": "train"}\n')
    (demo / RUNS / "r0-broken.json").write_text('{"run_id": "r0-broken", "stag')

    result = conveyor("runs")
    assert result.exit_code == 0, result.output
    assert first_cells(result.stdout) == ["run", "r4-new", "r2-eta", "r1-old"]  # newest first; not: another
    # spec's run, latest.json (a copy), the events file, a broken record (said on stderr)
    started = datetime.fromisoformat("2026-11-24T10:05:00+00:00").astimezone().strftime("%Y-%m-%d %H:%M")
    # run, started (local time), status, wall, stages ran (failed ones too), skipped, failed, -S
    assert lines_of(result.stdout, "r2-eta") == [["r2-eta", *started.split(), "failed", "2.5s", "1", "1", "1",
                                                  "train.xgb.eta=0.3"]]
    assert lines_of(result.stdout, "r1-old")[0][3:] == ["succeeded", "1.0s", "1", "0", "0"]
    assert result.stderr.strip() == f"skipped {RUNS}/r0-broken.json: not a readable run record"

    assert first_cells(conveyor("runs", "--last", "2").stdout) == ["run", "r4-new", "r2-eta"]
    other = conveyor("runs", "-c", "configs/other.yaml").stdout  # records without a spec: the default one's
    assert first_cells(other) == ["run", "r3-other"]


def first_cells(output: str) -> list[str]:
    """The first cell of each table line (the header's, then each run's), rules left out."""
    return [line.split()[0] for line in output.splitlines() if line.strip() and not line.startswith("─")]


def test_no_runs_yet(demo: Path) -> None:
    result = conveyor("runs")
    assert (result.exit_code, result.stdout.strip()) == (0, "no runs of configs/pipeline.yaml yet "
                                                             "(`conveyor run` makes one)")
    assert conveyor("compare").stdout.strip() == "no runs of configs/pipeline.yaml yet (`conveyor run` makes one)"


# ------------------------------------------------------------------- conveyor compare

def plain_runs(root: Path) -> None:
    """Two runs of a plain pipeline; the second set train.eta with -S."""
    params = {"preprocess.test_size": 0.2, "train": {"eta": 0.1, "depth": 6}}
    stages = {"prepare": StageRecord("skipped"), "train": StageRecord("succeeded", metrics={"acc": 0.912345})}
    write_run(root, "20261124T100000-aaaaaa", 0, params=params, stages=stages)
    params["train"] = {"eta": 0.3, "depth": 6}
    stages = {"prepare": StageRecord("skipped"), "train": StageRecord("succeeded", metrics={"acc": 0.95, "n": 120.0})}
    write_run(root, "20261124T100500-bbbbbb", 5, params=params, overrides={"train.eta": 0.3}, stages=stages)


def test_compare_two_runs_differing_by_one_param(demo: Path) -> None:
    plain_runs(demo)
    result = conveyor("compare", "20261124T1000", "20261124T100500-bbbbbb")  # a unique prefix, a whole id
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[0].strip() == "demo (configs/pipeline.yaml): 2 runs"
    # what changed (train.eta, set with -S) and every metric; the params the same in both are left out
    assert [line.split() for line in out[1:3]] == [["train.", "train:", "train:"], ["run", "eta", "acc", "n"]]
    assert set(out[3]) == {"─"}
    assert lines_of(result.stdout, "20261124T100000-aaaaaa") == [["20261124T100000-aaaaaa", "0.1", "0.9123", "-"]]
    assert lines_of(result.stdout, "20261124T100500-bbbbbb") == [["20261124T100500-bbbbbb", "0.3*", "0.95", "120"]]
    caption = " ".join(" ".join(out[out.index(next(line for line in out if line.startswith("*"))):]).split())
    assert caption == "* set with -S in that run; 2 params the same in every row not shown (--all shows them)"
    assert conveyor("compare").stdout == result.stdout  # no ids: the last runs of the spec, oldest first

    every = conveyor("compare", "--all").stdout.splitlines()
    assert [line.split() for line in every[1:3]] == [["preprocess.", "train.", "train.", "train:", "train:"],
                                                     ["run", "test_size", "eta", "depth", "acc", "n"]]
    assert lines_of("\n".join(every), "20261124T100500-bbbbbb") == [
        ["20261124T100500-bbbbbb", "0.2", "0.3*", "6", "0.95", "120"]]


def test_compare_of_runs_with_no_params_or_metrics_keeps_its_title_on_one_line(demo: Path) -> None:
    """A pipeline of commands that declare neither: the table is one column of run ids, and its
    title (wider than that column) stays whole above it."""
    for n, run_id in enumerate(("20261124T100000-aaaaaa", "20261124T100500-bbbbbb")):
        write_run(demo, run_id, 5 * n, stages={"train": StageRecord("succeeded")})
    out = conveyor("compare").stdout.splitlines()
    assert out[0].strip() == "demo (configs/pipeline.yaml): 2 runs"
    assert out[1].split() == ["run"] and [line.split() for line in out[3:5]] == [
        ["20261124T100000-aaaaaa"], ["20261124T100500-bbbbbb"]]


def test_compare_for_scripts_every_param_unfolded(demo: Path) -> None:
    plain_runs(demo)
    shown = conveyor("compare", "--json")
    assert shown.exit_code == 0, shown.output
    rows = json.loads(shown.stdout)
    assert [(r["run"], r["item"], r["params"], r["set_with_S"], r["metrics"]) for r in rows] == [
        ("20261124T100000-aaaaaa", None, {"preprocess.test_size": 0.2, "train.eta": 0.1, "train.depth": 6}, [],
         {"train:acc": 0.912345}),  # unrounded, for scripts
        ("20261124T100500-bbbbbb", None, {"preprocess.test_size": 0.2, "train.eta": 0.3, "train.depth": 6},
         ["train.eta"], {"train:acc": 0.95, "train:n": 120})]
    table = list(csv.reader(io.StringIO(conveyor("compare", "--csv").stdout)))
    assert table == [["run", "item", "preprocess.test_size", "train.eta", "train.depth", "train:acc", "train:n"],
                     ["20261124T100000-aaaaaa", "", "0.2", "0.1", "6", "0.912345", ""],
                     ["20261124T100500-bbbbbb", "", "0.2", "0.3", "6", "0.95", "120.0"]]
    both = conveyor("compare", "--json", "--csv")  # main() makes it one line and exit 2
    assert isinstance(both.exception, UsageError) and str(both.exception) == "--json and --csv: give one of them"


def test_a_long_list_param_is_folded_to_its_size_and_a_digest() -> None:
    from conveyor.run.compare import fmt

    columns = [f"feature_{i}" for i in range(31)]
    folded = fmt(columns)
    assert folded.startswith("[31 items #") and folded.endswith("]") and len(folded) <= 20
    assert fmt([*columns[:-1], "other"]) != folded  # two lists that differ read differently
    assert fmt({"a": list(range(20))}).startswith("{1 keys #")
    assert fmt(["a", "b"]) == '["a", "b"]'  # short: as it is


def matrix_runs(root: Path) -> None:
    """A 2x2 matrix (train@eta-depth) and an evaluate stage, run twice; the second run set rounds."""
    for n, (run_id, rounds) in enumerate([("20261124T100000-aaaaaa", 100), ("20261124T100500-bbbbbb", 200)]):
        stages = {f"train@{eta}-{depth}": StageRecord(
            "succeeded", item={"eta": eta, "depth": depth}, metrics={"acc": round(eta * depth + n, 3)})
            for eta in (0.1, 0.3) for depth in (6, 8)}
        stages["evaluate"] = StageRecord("skipped" if n else "succeeded", metrics={"auc": 0.9 + n / 100})
        write_run(root, run_id, 5 * n, params={"train.rounds": rounds}, stages=stages,
                  overrides={"train.rounds": rounds} if n else {})


def test_compare_a_matrix_lines_up_each_item_across_runs(demo: Path) -> None:
    matrix_runs(demo)
    result = conveyor("compare")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert [line.split() for line in out.splitlines()[1:3]] == [["train.", "item.", "item.", "evaluate:", "train:"],
                                                                ["run", "rounds", "eta", "depth", "auc", "acc"]]
    first, second = out.split("20261124T100500-bbbbbb")
    # each run: its own row (its params, evaluate's metric), then a row per item (its values, its acc)
    assert lines_of(first, "20261124T100000-aaaaaa") == [["20261124T100000-aaaaaa", "100", "-", "-", "0.9", "-"]]
    assert [line.split() for line in first.splitlines() if "train@" in line] == [
        ["├", "train@0.1-6", "100", "0.1", "6", "-", "0.6"],
        ["├", "train@0.1-8", "100", "0.1", "8", "-", "0.8"],
        ["├", "train@0.3-6", "100", "0.3", "6", "-", "1.8"],
        ["└", "train@0.3-8", "100", "0.3", "8", "-", "2.4"]]
    assert second.splitlines()[0].split() == ["200*", "-", "-", "0.91", "-"]  # a skipped stage's metric shows
    assert [line.split() for line in second.splitlines() if "train@" in line] == [
        ["├", "train@0.1-6", "200*", "0.1", "6", "-", "1.6"],
        ["├", "train@0.1-8", "200*", "0.1", "8", "-", "1.8"],
        ["├", "train@0.3-6", "200*", "0.3", "6", "-", "2.8"],
        ["└", "train@0.3-8", "200*", "0.3", "8", "-", "3.4"]]


def test_the_artifact_of_a_run_holds_the_rows_compare_shows(demo: Path) -> None:
    matrix_runs(demo)
    run = parse_record(json.loads((demo / RUNS / "20261124T100000-aaaaaa.json").read_text()))
    rows = artifact_rows(run)
    assert rows[0] == {"run": run.run_id, "item": "-", "train.rounds": "100", "item.eta": "-", "item.depth": "-",
                       "evaluate:auc": "0.9", "train:acc": "-"}
    assert rows[4] == {"run": run.run_id, "item": "train@0.3-8", "train.rounds": "100", "item.eta": "0.3",
                       "item.depth": "8", "evaluate:auc": "-", "train:acc": "2.4"}
    assert len(rows) == 5


def test_a_password_in_a_param_is_shown_nowhere(demo: Path) -> None:
    """The table, the page and the Prefect artifact show a source URL without its credentials."""
    run = write_run(demo, "r1", 0, params={"ingest": {"sources": ["https://alice:s3cret@host/a.csv"]}},
                    overrides={"ingest.url": "https://TOKEN@host/b.csv"})
    assert artifact_rows(run) == [{"run": "r1", "item": "-", "ingest.sources": '["https://***@host/a.csv"]',
                                   "ingest.url": "https://***@host/b.csv*", "train:acc": "0.9"}]
    shown = conveyor("compare", "--plot", "page.html").stdout + conveyor("runs").stdout
    assert "https://***@host/b.csv" in shown
    assert not [text for text in (shown, (demo / "page.html").read_text()) if "s3cret" in text or "TOKEN" in text]


def test_many_metrics_turn_the_table_a_row_per_metric(demo: Path) -> None:
    """Twenty metrics do not fit 80 columns as columns: they become rows, a column per run."""
    for n, run_id in enumerate(["r1", "r2"]):
        write_run(demo, run_id, n, params={"train.eta": 0.1 * (n + 1)},
                  stages={"train": StageRecord("succeeded", metrics={f"m{i}": i + n / 10 for i in range(20)})})
    runs = [parse_record(json.loads((demo / RUNS / f"{r}.json").read_text())) for r in ("r1", "r2")]
    console = Console(width=80, color_system=None, record=True)
    console.print(compare_table(rows_of(runs), width=80))
    text = console.export_text()
    assert ["r1", "r2"] in [line.split() for line in text.splitlines()]
    assert lines_of(text, "train.eta") == [["train.eta", "0.1", "0.2"]]
    assert lines_of(text, "train:m19") == [["train:m19", "19", "19.1"]]
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_record_of_another_version_or_broken_is_read_or_skipped(demo: Path) -> None:
    record = parse_record({"run_id": "x", "pipeline": "demo", "extra": 1,
                           "stages": {"a": {"status": "skipped", "new_field": [1]}}})
    assert (record.spec, record.params, record.stages["a"].metrics, record.stages["a"].item) == ("", {}, {}, None)
    broken: object
    for broken in ([], {"pipeline": "demo"}, {"run_id": "x", "pipeline": "demo", "params": [1]},
                   {"run_id": "x", "pipeline": "demo", "stages": {"a": {"metrics": "none"}}}):
        with pytest.raises((ValueError, TypeError)):
            parse_record(broken)


def test_the_last_success_of_each_stage_is_read_from_the_newest_records_only(
        demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a run compares its stages' environment with: a project's thousands of records are not all read."""
    from conveyor.run import record
    from conveyor.run.environment import last_successes

    for minute in range(5):
        write_run(demo, f"20261124T10{minute:02d}00-aaaaaa", minute, stages={
            "train": StageRecord("succeeded", metrics={"minute": minute}),
            "prep": StageRecord("succeeded" if minute == 1 else "skipped")})
    write_run(demo, "20261124T1005-failed", 5, status="failed", stages={"train": StageRecord("failed")})
    parse, read = record.parse_record, []
    monkeypatch.setattr(record, "parse_record", lambda data: read.append(data["run_id"][9:13]) or parse(data))
    found = last_successes(record.newest_runs(demo), ["train", "prep"])
    assert found["train"].metrics == {"minute": 4} and found["prep"].status == "succeeded"
    assert read == ["1005", "1004", "1003", "1002", "1001"]  # newest first, up to prep's success: not 1000


# ------------------------------------------------------------------- --plot

def test_plot_writes_one_escaped_svg_page_with_a_series_per_run(demo: Path) -> None:
    hostile = "<script>alert(1)</script>"
    matrix_runs(demo)
    for n, note in enumerate(["plain", hostile]):
        write_run(demo, f"20261124T11000{n}-note{n}", 30 + n, params={"train.note": note},
                  stages={"train": StageRecord("succeeded", metrics={"loss": 0.5 - n / 10})})
    result = conveyor("compare", "20261124T1000", "20261124T1005", "--plot", "out.html")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "wrote out.html"
    page = (demo / "out.html").read_text()
    charts = [ET.fromstring(svg) for svg in svg_parts(page)]
    assert [c.get("data-metric") for c in charts] == ["evaluate:auc", "train:acc"]
    for chart in charts:  # one series per run, each its own colour
        series = [g for g in chart.iter(f"{SVG}g") if g.get("class") == "series"]
        assert [g.get("data-run") for g in series] == ["20261124T100000-aaaaaa", "20261124T100500-bbbbbb"]
        assert len({g.get("fill") for g in series}) == 2
    acc = charts[1]
    assert x_label(acc) == "item.eta"  # against the first item value; a line per run and other value
    line_ends = [[t.text for t in g.iter(f"{SVG}text")] for g in acc.iter(f"{SVG}g")]
    assert line_ends == [["item.depth=6", "item.depth=8"]] * 2
    assert x_label(charts[0]) == "train.rounds"  # evaluate:auc, a metric of each run: against the param set with -S
    tips = [t.text for t in acc.iter(f"{SVG}title")]
    assert "20261124T100500-bbbbbb · train@0.3-8 · item.eta=0.3 · item.depth=8 · train:acc=3.4" in tips
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing fetched

    result = conveyor("compare", "20261124T110000", "20261124T110001", "--plot", "notes.html")
    page = (demo / "notes.html").read_text()
    assert hostile not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    [chart] = [ET.fromstring(svg) for svg in svg_parts(page)]
    ticks = [t.text for t in chart.iter(f"{SVG}text")]
    assert "plain" in ticks and hostile in ticks and x_label(chart) == "train.note"  # the param that differs


def test_plot_leaves_out_what_has_no_value_and_keeps_its_axes_on_the_data(demo: Path, tmp_path: Path) -> None:
    """A run without the x param is not drawn at null, a failed run is in the legend as 'no value'
    (the legend lists the runs the title counts), close values get distinct y labels, and an
    error metric's axis does not run below zero."""
    write_run(demo, "20261124T120000-aaaaaa", 0, params={"train.eta": 0.1},
              stages={"train": StageRecord("succeeded", metrics={"rmse": 0.91234, "zero": 0.0})})
    write_run(demo, "20261124T120100-bbbbbb", 1, params={"train.eta": 0.3}, overrides={"train.eta": 0.3},
              stages={"train": StageRecord("succeeded", metrics={"rmse": 0.91236, "zero": 0.0})})
    write_run(demo, "20261124T120200-cccccc", 2, params={}, overrides={},  # an older spec: no train.eta
              stages={"train": StageRecord("succeeded", metrics={"rmse": 0.9125})})
    write_run(demo, "20261124T120300-dddddd", 3, params={"train.eta": 0.5}, status="failed",
              stages={"train": StageRecord("failed")})
    result = conveyor("compare", "--plot", "edge.html")
    assert result.exit_code == 0, result.output
    page = (demo / "edge.html").read_text()
    rmse, zero = (ET.fromstring(svg) for svg in svg_parts(page))
    assert x_label(rmse) == "train.eta"
    xs = [t.text for t in rmse.iter(f"{SVG}text") if t.get("y") == "215"]
    assert "null" not in xs and "None" not in xs, xs
    drawn = {g.get("data-run") for g in rmse.iter(f"{SVG}g") if g.get("class") == "series"}
    assert drawn == {"20261124T120000-aaaaaa", "20261124T120100-bbbbbb"}
    legend = ["".join(t.itertext()) for t in rmse.iter(f"{SVG}text") if t.get("class") == "legend"]
    assert legend == ["20261124T120000-aaaaaa", "20261124T120100-bbbbbb",
                      "20261124T120200-cccccc (no train.eta)", "20261124T120300-dddddd (no value)"]
    labels = [t.text for t in rmse.iter(f"{SVG}text") if t.get("class") == "y-tick"]
    assert len(labels) == len(set(labels)) >= 3, labels
    for chart in (rmse, zero):
        ticks = [float(t.text or "") for t in chart.iter(f"{SVG}text") if t.get("class") == "y-tick"]
        assert min(ticks) >= 0, ticks

    if CHROMIUM is not None:  # the page as a browser renders it: no console message, a picture
        shot = tmp_path / "edge.png"
        _, console = browse(demo / "edge.html", tmp_path / "chromium", f"--screenshot={shot}",
                            "--window-size=1600,900")
        print(f"screenshot of edge.html: {shot}")
        assert console == [] and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


SVG = "{http://www.w3.org/2000/svg}"


def x_label(chart: ET.Element) -> str | None:
    [label] = [t.text for t in chart.iter(f"{SVG}text") if t.get("class") == "x-label"]
    return label


def svg_parts(page: str) -> list[str]:
    return [f"<svg{part.split('</svg>')[0]}</svg>" for part in page.split("<svg")[1:]]


# ------------------------------------------------------------------- usage errors, as a user meets them

CONVEYOR = shutil.which("conveyor")


@pytest.mark.skipif(CONVEYOR is None, reason="the conveyor console script is not installed")
def test_usage_errors_exit_2_with_one_line(demo: Path) -> None:
    plain_runs(demo)
    (demo / "plots").mkdir()
    assert CONVEYOR is not None
    script = (f"exec 2>&1; {CONVEYOR} compare 20261124T100000-aaaaab; echo rc=$?; "
              f"{CONVEYOR} compare 2026 nope; echo rc=$?; "
              f"{CONVEYOR} compare --plot plots; echo rc=$?; "
              f"{CONVEYOR} compare --plot missing/x.html; echo rc=$?")
    done = subprocess.run(["sh", "-c", script], cwd=demo, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [
        "unknown run '20261124T100000-aaaaab' (close: 20261124T100000-aaaaaa, 20261124T100500-bbbbbb)", "rc=2",
        "run '2026' is ambiguous: it starts 2 run ids (20261124T100000-aaaaaa, 20261124T100500-bbbbbb); "
        "unknown run 'nope' (latest: 20261124T100500-bbbbbb, 20261124T100000-aaaaaa; `conveyor runs` lists them)",
        "rc=2",
        "--plot plots is a directory: name a file (e.g. --plot compare.html)", "rc=2",
        "--plot missing/x.html: the directory missing does not exist", "rc=2"]
    assert not (demo / "missing").exists()


def test_a_metric_no_param_explains_is_plotted_against_the_run_order(demo: Path) -> None:
    runs = [write_run(demo, f"r{n}", n, params={"train.eta": 0.1},
                      stages={"train": StageRecord("succeeded", metrics={"acc": 0.5 + n / 10})}) for n in range(3)]
    [chart] = [ET.fromstring(svg) for svg in svg_parts(chart_page(rows_of(runs), ["r0", "r1", "r2"], "demo"))]
    assert x_label(chart) == "run (in the order compared)"
    circles = [(float(c.get("cx", 0)), float(c.get("cy", 0))) for c in chart.iter(f"{SVG}circle")]
    assert sorted(circles) == circles and len(circles) == 3  # left to right in order, higher acc higher up
    assert circles[0][1] > circles[1][1] > circles[2][1]


def test_compare_of_the_reference_pipeline_fits_120_columns_and_names_the_changed_param(
        demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference project's own params.yaml (32 values, a 31-name column list among them) and the
    metrics its stages write, in two runs that differ by one param set with -S."""
    import yaml

    import conveyor.cli.past as past
    from conveyor.run.compare import flatten

    params = flatten(yaml.safe_load((REPO / "params.yaml").read_text()))
    stages = {}
    for name in ("train_xgb", "train_mlp", "test"):
        values = flatten(json.loads((REPO / "metrics" / f"{name}.json").read_text()))
        stages["evaluate" if name == "test" else name] = StageRecord(
            "succeeded", metrics={k: v for k, v in values.items() if isinstance(v, int | float)})
    write_run(demo, "20261124T100000-aaaaaa", 0, params=params, stages=stages)
    changed = {**params, "train.xgb.booster.max_depth": 6}
    write_run(demo, "20261124T100500-bbbbbb", 5, params=changed, stages=stages,
              overrides={"train.xgb.booster.max_depth": 6})
    monkeypatch.setattr(past, "out", Console(width=120, color_system=None))
    shown = conveyor("compare")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert max(map(len, lines)) <= 120, shown.stdout
    assert "max_depth" in shown.stdout and "6*" in shown.stdout  # the param that changed, marked as set by -S
    assert "ingest.columns" not in shown.stdout and "feature" not in shown.stdout  # the same in both: left out
    assert "31 params the same in every row not shown" in " ".join(shown.stdout.split())
