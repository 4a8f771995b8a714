"""Fetching many sources on a thread pool: fsspec URLs and globs, retries, checksums, byte ranges."""
