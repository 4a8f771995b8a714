"""Damage a parquet file the way a disk or a copy does: bytes of a data page overwritten, the footer intact."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def damage_page(path: Path) -> None:
    """Overwrite the last 4 bytes of the first column chunk's data page (encoded values, past the
    page's header); the footer, and so the file's schema and row counts, stay as they were."""
    footer = pq.read_metadata(path)
    column = footer.row_group(0).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    end = start + column.total_compressed_size  # the chunk's last page is a data page
    assert column.data_page_offset < end - 4
    data = bytearray(path.read_bytes())
    data[end - 4:end] = bytes(byte ^ 0xFF for byte in data[end - 4:end])
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).equals(footer)
