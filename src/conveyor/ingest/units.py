"""The units of work an ingest is cut into: byte ranges of a file, whole files, synthetic shards."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.ingest.sources import RemoteFile
from conveyor.ingest.synthetic import SyntheticSource


@dataclass(frozen=True)
class Block:
    """One newline-aligned byte range of one file: rows for one part."""

    index: int
    file: RemoteFile
    offset: int
    length: int
    nbytes: int  # bytes of data lines it will hold, summed over a file: the file's data size


@dataclass(frozen=True)
class Transfer:
    """One whole file, streamed, verified, then parsed into parts."""

    index: int
    file: RemoteFile
    nbytes: int | None


@dataclass(frozen=True)
class Shard:
    """One shard of a synthetic source."""

    index: int
    source: SyntheticSource
    shard: int
    nbytes: int


Unit = Block | Transfer | Shard
