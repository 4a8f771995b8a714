"""Benchmarks of conveyor, each a ratio of a candidate against the peer a user would pick instead, run side by
side in interleaved repetitions after checking both produced the same result: ``python -m benchmarks [NAME...]
[--quick]`` prints the table and writes ``benchmarks/results/<name>-<date>.txt``. Whole commands are timed by
hyperfine, process trees' memory sampled by psutil, HTTP load made by wrk: the package keeps only the projects,
the peers, the checks and the report (docs/benchmarks.md)."""
