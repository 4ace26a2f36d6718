"""Helpers the tests share with each other: an update's two settings objects from one set of
keyword arguments, and the child programs of the multi-rank update tests. Fixtures the benchmarks
use too (dataset files, the LLaDA reference decoder, a loopback S3 server) are in ``tools/``."""
