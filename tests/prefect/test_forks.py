"""What the warm runner makes once on Prefect's side for the runs it forks (conveyor.prefect.forks)."""

from __future__ import annotations

import subprocess
import sys


def test_the_models_prefect_put_off_are_built_once_for_the_forked_runs() -> None:
    """What the warm runner does before it forks (conveyor.prefect.forks): a run inherits Prefect's
    models built, instead of building those it uses itself."""
    script = (  # a process of its own: none of Prefect's models built yet, as in the runner
        "import prefect.flow_engine, prefect.artifacts, pydantic._internal._mock_val_ser as mock\n"
        "from prefect.client.schemas.actions import FlowRunCreate\n"
        "from conveyor.prefect.forks import complete_models\n"
        "assert isinstance(FlowRunCreate.__pydantic_validator__, mock.MockValSer)\n"
        "print(complete_models(), complete_models(), type(FlowRunCreate.__pydantic_validator__).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built, again, validator = done.stdout.split()
    assert int(built) > 100 and int(again) == 0 and validator == "SchemaValidator"
