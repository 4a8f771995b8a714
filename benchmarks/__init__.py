"""Benchmarks of conveyor: each one a ratio of a candidate against a baseline run side by side.

Absolute timings on a shared machine are noisy, so every benchmark runs its baseline and
its candidate in interleaved repetitions (the order alternates from one repetition to the
next) and reports the median per-repetition ratio with its spread. Each benchmark checks
that both sides produced the same result before it reports a ratio. Whole commands are
timed by hyperfine, process trees' memory sampled by psutil, HTTP load made by wrk: the
package keeps only the projects, the peers, the checks and the report.

    python -m benchmarks                      # every benchmark
    python -m benchmarks ingest-concurrency   # one of them
    python -m benchmarks --quick              # smaller sizes, fewer repetitions

Results are printed and written to ``benchmarks/results/<name>-<date>.txt``.
"""
