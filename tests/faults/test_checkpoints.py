"""Checkpoints that outlive a stopped attempt (``.conveyor/checkpoints/``): a ``cmd`` stage finds
in ``$CONVEYOR_CHECKPOINT_DIR`` what its failed attempt saved, says how far it got
(``Checkpoint.mark``), and the folder goes when the stage succeeds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from projects import Project

pytestmark = pytest.mark.slow
MakeProject = Callable[[], Project]


HALVES = """
set -e
if [ -e "$CONVEYOR_CHECKPOINT_DIR/first-half" ]; then
  cp "$CONVEYOR_CHECKPOINT_DIR/first-half" out.txt && echo second >> out.txt && exit 0
fi
echo first > "$CONVEYOR_CHECKPOINT_DIR/first-half"
python -c "from conveyor.run.checkpoints import current; current().mark(1, 2, 'half')"
echo stopped half-way >&2
exit 3
"""


def test_a_command_finds_what_its_failed_attempt_saved_and_a_success_drops_it(make_project: MakeProject) -> None:
    project = make_project()
    project.write("configs/pipeline.yaml", "pipeline: halves\nstages:\n"
                  "  halves: {cmd: sh halves.sh, deps: [halves.sh], outs: [out.txt]}\n")
    project.write("halves.sh", HALVES)
    first = project.conveyor("run")
    assert first.returncode == 1, first.stdout + first.stderr
    (saved,) = (project.root / ".conveyor/checkpoints/halves").iterdir()
    assert (saved / "first-half").read_text() == "first\n"
    again = project.conveyor("run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "halves resumes from half 1 of 2 (checkpoint of run " in again.stderr, again.stderr
    assert (project.root / "out.txt").read_text() == "first\nsecond\n"
    resumed = project.record()["stages"]["halves"]["resumed"]
    assert (resumed["step"], resumed["total"], resumed["unit"]) == (1, 2, "half")
    assert not (project.root / ".conveyor/checkpoints/halves").exists()
    recorded = "".join(p.read_text() for p in (project.root / ".conveyor/locks").iterdir())
    assert "checkpoint" not in recorded and "halves.sh" in recorded  # the record holds no checkpoint
