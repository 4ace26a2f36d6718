"""Helpers the tests share with each other and with the benchmarks: sample dataset files, the
loopback S3 server, the LLaDA reference decoder. Test fixtures, not product code."""
