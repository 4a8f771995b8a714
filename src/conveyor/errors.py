"""One exception tree for conveyor.

Each error carries typed attributes and builds its message in ``__str__``, so callers
(the CLI above all) can map it to an exit code without parsing text.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# the user information of a URL (``https://user:password@host``, ``https://TOKEN@host``)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"<>]+@")
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")  # CSI, OSC, Fe


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***`` (``https://***@host``).

    Sources are URLs, and a URL may carry a password or a token: whatever conveyor writes
    (console, stage logs, run records, Prefect's task runs and artifacts) goes through this.
    """
    return _USERINFO.sub(r"\g<scheme>***@", text)


def plain(text: str) -> str:
    """``text`` without terminal escape sequences (colours a tool such as DVC prints), for a
    one-line summary, the live view and the run record; a log file keeps the text as written."""
    return _ESCAPES.sub("", text)


class ConveyorError(Exception):
    """Base of every error conveyor raises on purpose."""

    exit_code: int = 1


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec file: where it is and what to do about it."""

    file: Path
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else f"{self.file}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}{key} {self.message}"


class SpecError(ConveyorError, ValueError):
    """The spec (or params file) is invalid. Holds every issue found, not just the first."""

    exit_code = 2

    def __init__(self, issues: list[SpecIssue]) -> None:
        super().__init__(issues)
        self.issues = issues

    def __str__(self) -> str:
        files = sorted({str(i.file) for i in self.issues})
        n = len(self.issues)
        head = f"{n} error{'s' if n != 1 else ''} in {', '.join(files)}:"
        return "\n".join([head, *(f"  {i}" for i in self.issues)])


class UsageError(ConveyorError, ValueError):
    """The command line asks for something the spec does not have."""

    exit_code = 2


class ProfileError(ConveyorError, RuntimeError):
    """A compute profile could not be started (no GPU and no fallback, cluster unreachable)."""

    exit_code = 1


@dataclass
class StageError(ConveyorError, RuntimeError):
    """A stage's task failed, or did not write the outs it declared."""

    stage: str
    reason: str

    def __str__(self) -> str:
        return f"stage '{self.stage}' failed: {self.reason}"


class RedactedError(ConveyorError, RuntimeError):
    """A stage's error whose message named a credential, raised in its place (``from None``)
    so that Prefect stores and logs the redacted text only."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class MissingOutputError(StageError):
    """A stage finished but left a declared out unwritten."""


class RunLockedError(ConveyorError, RuntimeError):
    """Another conveyor run holds the project's run lock; ``pid``: its process, where known."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


# a file system that refuses writes (a read-only checkout, a full disk, a quota): not a bug in conveyor
UNWRITABLE = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM})


class UnwritableError(ConveyorError, OSError):
    """conveyor could not write ``filename`` (``errno`` in :data:`UNWRITABLE`).

    An OSError still, so code that tolerates a failed write (a cache of a check) keeps doing so;
    its arguments are OSError's own, so it crosses pickling unchanged. The message names the path
    and the errno, and says what to do, in one line.
    """

    exit_code = 1

    def __init__(self, code: int, strerror: str, path: str) -> None:
        super().__init__(code, strerror, path)

    @classmethod
    def of(cls, exc: OSError, path: os.PathLike[str] | str | None = None) -> OSError:
        """``exc`` as an UnwritableError naming ``path`` (else the path ``exc`` names), when its
        errno says the file system refused the write; ``exc`` itself otherwise."""
        if isinstance(exc, UnwritableError) or exc.errno not in UNWRITABLE:
            return exc
        where = path if path is not None else exc.filename
        return cls(exc.errno, os.strerror(exc.errno), str(where) if where is not None else "")

    def __str__(self) -> str:
        code = self.errno if self.errno is not None else 0
        name = errno.errorcode.get(code, str(code))
        full = code in (errno.ENOSPC, errno.EDQUOT)
        todo = "free some space, then run again (what succeeded stays recorded)" if full else \
            "run it in a writable copy of the project"
        what = f"write {self.filename}" if self.filename else f"write in {os.getcwd()}"  # a write that named no file
        return f"cannot {what}: {self.strerror} ({name}): {todo}"


class DamagedFileError(ConveyorError, ValueError):
    """A data file whose content is damaged although it opens (a parquet page fails its checksum).

    ``path`` as the reader opened it; ``reason`` says what is wrong, with the library's own words.
    A ValueError, as the reference tasks' other bad-data errors; its arguments are its fields,
    so it crosses a Dask worker's pickling unchanged.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return redact(f"{self.path} is damaged: {self.reason}: write it again")  # a path may be a URL


class RemoteDataError(ConveyorError, RuntimeError):
    """Moving a stage's data through the DVC remote failed (a stage on workers without the project's
    disk): the remote is out of reach of one side (a path the workers do not mount, a bucket without
    their credentials), or a disk on the way is full. Travels back from a Dask worker (pickles)."""

    def __init__(self, remote: str, url: str, doing: str, detail: str) -> None:
        super().__init__(remote, url, doing, detail)
        self.remote, self.url, self.doing, self.detail = remote, url, doing, detail

    def __str__(self) -> str:
        return redact(f"{self.doing} DVC remote '{self.remote}' ({self.url}) failed: {self.detail}; the runner and "
                      "the workers both need to reach it (a folder both mount, a bucket both have credentials for)")


class DamagedCacheError(ConveyorError, RuntimeError):
    """What DVC's cache restored for a stage does not hash to what DVC recorded for it: a cache
    object damaged on disk, which DVC trusts without reading. Not a failure: the stage runs instead.

    ``outs``: the outs restored wrong; ``objects``: the damaged cache objects, moved into ``aside``;
    ``stuck``: damaged objects that could not be moved (a cache this user cannot write).
    """

    def __init__(self, stage: str, *, outs: list[str], objects: list[str], stuck: list[str], aside: str) -> None:
        super().__init__(stage, outs, objects, stuck, aside)
        self.stage, self.outs, self.objects, self.stuck, self.aside = stage, outs, objects, stuck, aside

    def __str__(self) -> str:
        damaged = [*self.objects, *self.stuck]
        outs = ", ".join(self.outs) or "its outs"
        if not damaged:
            return (f"{self.stage}: what DVC's cache restored for {outs} is not what DVC recorded, so "
                    f"{self.stage} runs instead (check the disk that holds DVC's cache)")
        many = len(damaged) > 1
        text = (f"{self.stage}: DVC's cache object{'s' if many else ''} {', '.join(damaged)} "
                f"{'are' if many else 'is'} damaged (no longer the bytes {'their names' if many else 'its name'} "
                f"record{'' if many else 's'}), so {self.stage} runs instead of restoring {outs} from it")
        if self.objects:
            text += f"; moved into {self.aside} (check that disk, then delete {'them' if many else 'it'})"
        if self.stuck:
            text += f"; could not move {', '.join(self.stuck)}: delete it by hand"
        return text

    @property
    def reason(self) -> str:
        """Why the stage ran, for the run record and the summary."""
        return "DVC's cache held damaged objects: ran instead of restoring" if self.objects or self.stuck \
            else "DVC's cache restored wrong bytes: ran instead of restoring"


class RegistryError(ConveyorError, ValueError):
    """The model registry, or a metric a promotion compares, cannot be read or written."""

    exit_code = 1


class DeployError(ConveyorError, RuntimeError):
    """Deployments cannot be registered or served (no prefect.yaml, no Prefect server, a bad entry)."""

    exit_code = 1


class PrefectServerError(ConveyorError):
    """The temporary Prefect server a run starts (no PREFECT_API_URL) did not answer."""


@dataclass
class PrefectServerGone(PrefectServerError):
    """The Prefect server a run records in does not answer: at the start (``while_running`` False:
    nothing ran), or it stopped answering during the run (its stages ran and are recorded; only
    Prefect's copy of the run is incomplete). ``why``: what the probe found."""

    url: str
    why: str
    while_running: bool = False
    recorded_in: str = "dvc.lock and .conveyor/runs"  # where the stages' outcomes are

    def __str__(self) -> str:
        if self.while_running:
            return (f"the Prefect server at {self.url} stopped answering ({self.why}): the run's stages are "
                    f"recorded in {self.recorded_in}; its flow run in Prefect is incomplete")
        return (f"the Prefect server at {self.url} does not answer ({self.why}): start it, or unset "
                "PREFECT_API_URL to run with a temporary server")


@dataclass
class PrefectServerRefused(PrefectServerError):
    """The Prefect API a run records in refused its requests for want of credentials (HTTP 401 or 403)."""

    url: str
    status: str

    def __str__(self) -> str:
        return (f"the Prefect API at {self.url} refuses conveyor's requests ({self.status}): give its credentials "
                "(PREFECT_API_KEY for Prefect Cloud, PREFECT_API_AUTH_STRING for a server started with "
                "PREFECT_SERVER_API_AUTH_STRING)")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped the command; ``signal_name`` says which.

    A KeyboardInterrupt, so that everything unwinding (journals, clusters, servers) treats
    SIGTERM exactly as Ctrl-C; the command line exits 130 or 143 by the name.
    """

    def __init__(self, signal_name: str = "SIGINT") -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
