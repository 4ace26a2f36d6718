"""Benchmarks: each runs as ``python -m benchmarks.NAME``, prints a table and writes
``benchmarks/results/NAME.json``. Results are outputs, never committed."""
