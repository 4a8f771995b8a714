"""The installed ``conveyor`` console script, as a user types it: usage errors, --version, completion.

Runs the real entry point in a subprocess, against whatever typer/click a fresh install
resolved: every usage error is one line, exit 2, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from prefect_homes import new_home

CONVEYOR = shutil.which("conveyor")
pytestmark = pytest.mark.skipif(CONVEYOR is None, reason="the conveyor console script is not installed")

SPEC = """\
pipeline: tiny
stages:
  prepare: {cmd: "echo prepared > prepared.txt", outs: [prepared.txt]}
  train: {cmd: "cat prepared.txt > model.txt", deps: [prepared.txt], outs: [model.txt]}
"""


def conveyor(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    assert CONVEYOR is not None
    return subprocess.run([CONVEYOR, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100", **(env or {})})


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'tiny'\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/pipeline.yaml").write_text(SPEC)
    return tmp_path


def one_line_usage_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["runn"], r"^conveyor: No such command 'runn'\. Did you mean 'run', 'runs'\?"),
    (["comapre"], r"^conveyor: No such command 'comapre'\. Did you mean 'compare', 'compile'\?"),
    (["run", "--forse"], r"^conveyor run: No such option: --forse \(did you mean '--force'\?\)"),
    (["status", "--exit-cod"], r"^conveyor status: No such option: --exit-cod \(did you mean '--exit-code'\?\)"),
    (["dag", "--format", "png"], r"^conveyor dag: .*'png' is not one of 'text', 'mermaid', 'dot'"),
    (["serve", "--limit", "0"], r"^conveyor serve: .*--limit"),
    (["exec"], r"^conveyor exec: Missing argument 'STAGE'"),
    (["run", "-c"], r"^conveyor( run)?: Option '-c' requires an argument"),
])
def test_usage_errors_are_one_line_exit_2(args: list[str], expected: str) -> None:
    line = one_line_usage_error(conveyor(*args))
    assert re.search(expected, line), line
    assert line.endswith("--help')")


def test_no_arguments_shows_the_commands_and_exits_2() -> None:
    result = conveyor()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Usage: conveyor" in result.stderr
    for command in ("run", "status", "logs", "compile", "init"):
        assert re.search(rf"^  {command}\s", result.stderr, re.MULTILINE), command


def test_version() -> None:
    result = conveyor("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"conveyor {version('conveyor')}"


def test_help_shows_no_python_types() -> None:
    result = conveyor("run", "--help")
    assert result.returncode == 0
    assert "<bool>" not in result.stdout and "list[str]" not in result.stdout and "<path>" not in result.stdout
    assert "NAME=PROFILE" in result.stdout and "--single-item" in result.stdout


def test_bad_stage_names_are_usage_errors(tiny: Path) -> None:
    line = one_line_usage_error(conveyor("run", "trian", cwd=tiny))
    assert "unknown stage(s): trian (did you mean 'train'?)" in line
    line = one_line_usage_error(conveyor("run", "-s", cwd=tiny))
    assert "-s/--single-item runs only the stages you name" in line
    line = one_line_usage_error(conveyor("logs", "trian", cwd=tiny))
    assert "no log of stage 'trian'" in line


def test_dvc_repro_flags_in_a_project_without_dvc(tiny: Path) -> None:
    """``--no-commit``, ``--allow-missing`` (DVC's cache) and ``-R`` (dvc.yaml files) have no meaning
    there: one line, exit 2, nothing run; ``--dry`` is ``--dry-run``."""
    for flag in ("--no-commit", "--allow-missing"):
        line = one_line_usage_error(conveyor("run", flag, cwd=tiny))
        assert line.startswith(f"{flag} is a flag of DVC's record"), line
    assert not (tiny / "prepared.txt").exists()
    dry = conveyor("run", "--dry", cwd=tiny)  # dvc repro's spelling of --dry-run
    assert dry.returncode == 0 and "never run" in dry.stdout, dry.stdout + dry.stderr
    assert not (tiny / "prepared.txt").exists()
    line = one_line_usage_error(conveyor("run", "-R", ".", cwd=tiny))
    assert line.startswith("-R/--recursive picks the stages of the dvc.yaml files in a directory"), line


def test_shell_completion_script_and_stage_names(tiny: Path) -> None:
    # what `conveyor --install-completion` puts in ~/.bashrc
    script = conveyor(env={"_CONVEYOR_COMPLETE": "source_bash"})
    assert script.returncode == 0 and "_conveyor_completion()" in script.stdout
    result = conveyor(cwd=tiny, env={"_CONVEYOR_COMPLETE": "complete_bash", "COMP_WORDS": "conveyor run tr",
                                     "COMP_CWORD": "2"})
    assert result.returncode == 0
    assert result.stdout.split() == ["train"]


def test_spec_outside_the_project(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("specs") / "other.yaml"
    elsewhere.write_text(SPEC.replace("tiny", "elsewhere"))
    result = conveyor("validate", "-c", str(elsewhere), cwd=tiny)
    assert result.returncode == 0, result.stderr
    assert f"{elsewhere}: ok (2 stages" in result.stdout
    lonely = conveyor("validate", "-c", str(elsewhere), cwd=elsewhere.parent)
    assert lonely.returncode == 2 and "no project found" in lonely.stderr and "Traceback" not in lonely.stderr


def test_status_exit_code(tiny: Path) -> None:
    stale = conveyor("status", "--exit-code", cwd=tiny)
    assert stale.returncode == 1 and "never run" in stale.stdout
    assert conveyor("status", cwd=tiny).returncode == 0


def test_a_prefect_setting_that_does_not_validate_is_one_line_exit_2(tiny: Path) -> None:
    """Prefect validates its settings as it is imported: the bad one is named, not pydantic's traceback
    (Prefect's own "Failed to initialize plugins" lines may come before it)."""
    done = conveyor("run", cwd=tiny, env={"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "often", "CONVEYOR_WARM": "0"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Prefect's settings: PREFECT_FLOWS_HEARTBEAT_FREQUENCY='often': Input should be a valid integer, "
        "unable to parse string as an integer: fix or unset it")


@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_a_warm_idle_time_that_is_not_seconds_is_one_line_exit_2(tiny: Path, value: str) -> None:
    """Not a silent run without warm runners, as it was: said as a bad CONVEYOR_SERVER_IDLE is."""
    done = conveyor("status", cwd=tiny, env={"CONVEYOR_WARM_IDLE": value})
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == (f"CONVEYOR_WARM_IDLE={value!r}: give the seconds a warm runner waits unused before it "
                           "ends (0: no runners)\n")


@pytest.mark.slow
def test_a_run_on_the_embedded_server_prints_nothing_of_prefect(tiny: Path, tmp_path_factory: pytest.TempPathFactory
                                                                ) -> None:
    """No PREFECT_API_URL: conveyor starts Prefect's temporary server itself (Prefect does not start
    a second one), and the terminal shows nothing of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(new_home(tmp_path_factory.mktemp("prefect-home"))), COLUMNS="100")
    assert CONVEYOR is not None
    done = subprocess.run([CONVEYOR, "run"], cwd=tiny, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    for noise in ("prefect", "Prefect", "temporary server", "Flow run", "Task run"):
        assert noise not in terminal, noise
    assert "prefect:" not in terminal  # no link: the embedded server's UI ends with the run
    assert done.stdout.rstrip().splitlines()[-1].startswith("record:  .conveyor/runs/")  # the summary ends it
    assert "Error" not in terminal
    run_log = next((tiny / ".conveyor/logs").glob("*/run.log"))
    assert "Beginning flow run" in run_log.read_text()
    assert "Starting temporary server" not in run_log.read_text()  # Prefect used conveyor's server
    assert (run_log.parent / "prefect-server.log").exists()


NOTHING_HEAVY = """
import sys
from conveyor.cli.app import main
sys.argv = ["conveyor", "run"]
try:
    main()
except SystemExit as exc:
    code = exc.code
print("heavy:", sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "dask", "distributed", "dvc"}))
sys.exit(code)
"""


def test_a_run_with_nothing_to_do_starts_no_server_and_imports_no_prefect(
        tiny: Path, tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> None:
    """Decided before anything heavy: no Prefect import, no server (its database never made), no flow run."""
    assert CONVEYOR is not None
    first = subprocess.run([CONVEYOR, "run"], cwd=tiny, env={**os.environ, **prefect_server}, capture_output=True,
                           text=True, timeout=300)  # the test session's server: what is run next has none
    assert first.returncode == 0, first.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["COLUMNS"] = "100"
    home = tmp_path_factory.mktemp("untouched-home")
    env["PREFECT_HOME"] = str(home)
    again = subprocess.run([sys.executable, "-c", NOTHING_HEAVY], cwd=tiny, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "heavy: []" in again.stdout  # the record here is conveyor's own: not even DVC
    assert "up to date" in again.stdout
    assert list(home.iterdir()) == []  # no server ever opened a database there
    record = json.loads((tiny / ".conveyor/runs/latest.json").read_text())
    assert {s["status"] for s in record["stages"].values()} == {"skipped"}
    assert not record["flow_run_id"]
    assert not (tiny / ".conveyor/logs" / record["run_id"] / "prefect-server.log").exists()
