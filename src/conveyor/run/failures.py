"""What a failed stage says: one line for the summary and the record, and the task's own frames.

The line names the error and its root cause (``raise ... from``) and never a credential: a URL's
password is masked, and an exception that names one anywhere in its chain becomes a
:class:`~conveyor.errors.RedactedError` before Prefect or a log sees it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from conveyor.errors import RedactedError, plain, redact
from conveyor.run.commands import CommandFailed


def failure_detail(exc: BaseException, root: Path) -> str:
    """What to show under a failed stage: a command's last lines of stderr, or the task's own frames."""
    if isinstance(exc, CommandFailed):
        return redact("\n".join(f"  {line}" for line in exc.tail))
    return redact(user_frames(exc, root))


def user_frames(exc: BaseException, root: Path) -> str:
    """The traceback lines that point into the project's own code (its tasks), not libraries."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(root)]
    return "".join(traceback.format_list(frames)).rstrip()


def short_error(exc: BaseException) -> str:
    """The error's type and first line, credentials in URLs redacted."""
    if isinstance(exc, RedactedError):
        return plain(str(exc))
    line = plain(_first_line(exc))
    root = _root_cause(exc)
    if root is not None:  # e.g. Dask's "Error during deserialization" over "No module named 'tasks'"
        line += f" (caused by {plain(_first_line(root))})"
        if isinstance(root, ImportError) and "deserializ" in str(exc):
            line += ("; the Dask scheduler or workers cannot import code the task sends them from outside "
                     "the project (install it there, or run the stage on a local profile)")
    return redact(line)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _root_cause(exc: BaseException) -> BaseException | None:
    """The exception at the bottom of ``exc``'s explicit chain (``raise ... from``), if any."""
    root, seen = exc.__cause__, {id(exc)}
    while root is not None and root.__cause__ is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__
    return root


def redacted(exc: Exception) -> Exception:
    """``exc``, or a :class:`RedactedError` with its redacted message when it, or an exception
    it was raised from, names a credential (in its message, its repr or its arguments)."""
    chain: BaseException | None = exc
    seen: set[int] = set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        text = f"{chain!s} {chain!r}"
        if redact(text) != text:
            return RedactedError(short_error(exc))
        chain = chain.__cause__ or chain.__context__
    return exc
