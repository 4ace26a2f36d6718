"""The benchmarks' own tests: their harness, the scale model's arithmetic, each benchmark's smoke
run and the pieces a benchmark computes that a test can check against a hand-computed value. They
live here, not in ``tests/``, so the library's suite never imports a benchmark."""
