"""The commands of a docs page's ```bash blocks, as the doc tests run them (tests/test_docs.py,
and tests/cli/test_init.py for own-project.md): see tests/test_docs.py for what is run and what not."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

SKIP_BLOCK = "<!-- not run by the doc test:"
FENCE = re.compile(r"^```bash\s*$")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
EXPECT = re.compile(r"\(doc test: exit (\d+)\)")


@dataclass(frozen=True)
class Command:
    """One command of a page, with the exit code the page promises for it."""

    text: str
    exit_code: int


def commands(page: str) -> list[Command]:
    """The commands of a page's ```bash blocks that the doc test runs, in order."""
    lines = page.splitlines()
    found: list[Command] = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            skip = i > 0 and lines[i - 1].startswith(SKIP_BLOCK)
            i += 1
            while not lines[i].startswith("```"):
                i, command = _command(lines, i)
                if command is not None and not skip:
                    found.append(command)
        i += 1
    return found


def _command(lines: list[str], i: int) -> tuple[int, Command | None]:
    """The command starting at line ``i`` (with its heredoc, if any) and the line after it."""
    text = lines[i]
    stripped = text.strip()
    if not stripped or stripped.startswith("#"):
        return i + 1, None
    heredoc = HEREDOC.search(text)
    if heredoc:  # the body, up to its terminator, belongs to this command
        end = lines.index(heredoc.group(1), i + 1)
        text, i = "\n".join(lines[i:end + 1]), end
    if stripped.startswith("pip install") or "(not run by the doc test" in stripped:
        return i + 1, None
    expect = EXPECT.search(stripped)
    return i + 1, Command(text, int(expect.group(1)) if expect else 0)


def script(steps: list[Command]) -> str:
    """One bash script: each command, then a check of its exit code that stops at the first miss."""
    parts = ["set -u"]
    for step in steps:
        first = step.text.splitlines()[0]
        parts += [step.text, f'rc=$?; if [ $rc -ne {step.exit_code} ]; then echo "doc command exited $rc, '
                             f'not {step.exit_code}:" {shlex.quote(first)} >&2; exit 97; fi']
    return "\n".join(parts) + "\n"
