"""What a failure says: one plain line (no terminal colours from DVC), no dangling heading."""

from __future__ import annotations

from conveyor.run.failures import short_error


def test_terminal_colours_stay_out_of_one_line_errors_and_an_empty_stderr_leaves_no_heading() -> None:
    """DVC colours its messages; a summary, the live line and the run record get them plain."""
    from conveyor.run.commands import CommandFailed
    from conveyor.run.context import StageProgress

    coloured = RuntimeError("\x1b[31mERROR\x1b[39m: failed to reproduce 'train'")
    assert short_error(coloured) == "RuntimeError: ERROR: failed to reproduce 'train'"
    empty = CommandFailed("train", 2, ["", "   "])
    assert str(empty).endswith("command exited with status 2; it wrote nothing to stderr")
    assert str(CommandFailed("train", 2, ["\x1b[31mboom\x1b[0m", ""])).endswith("last lines of stderr:\n  boom")
    progress = StageProgress()
    progress.note("\x1b[36mRunning stage\x1b[39m 'train':")
    assert progress.last_line == "Running stage 'train':"
