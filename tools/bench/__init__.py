"""Benchmarks: `python -m tools.bench.NAME` prints a table (see docs/benchmarks.md)."""
