"""Benchmarks: each runs as ``python -m benchmarks.NAME``, prints a table and writes
``benchmarks/results/NAME.json`` (results are outputs, never committed); each has ``--smoke``, which
tests/test_bench_smoke.py runs in CI. The modules in ``HELPERS`` are not benchmarks but pieces
benchmarks share."""

HELPERS = {
    "harness": "arguments, SFT checkpoints, seeds in processes, paired tests, result files",
    "llada_reference": "LLaDA's generate and SDAR's block decoder written out, to time and check against",
    "loopback_s3": "moto's S3 server on 127.0.0.1 for runs whose store should be S3",
    "real_model_decode": "real_model's decoding measurements (latency, NSD FLOPs, the AR original)",
    "sample_files": "small files in each benchmark dataset's public format",
    "sim": "the discrete-event model scale_model runs",
    "standin": "emulate's calibrated compute stand-in process (python -m benchmarks.standin sampler|learner)",
}
