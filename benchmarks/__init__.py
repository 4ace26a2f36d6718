"""Benchmarks, in folders by the question they answer (README.md here is the index):

* ``learn/``: does training raise pass@1, and by how much against the field's other estimators;
* ``speed/``: what one rollout, update, sandboxed job or component costs on this machine;
* ``scale/``: what a run at cluster shape achieves (the scale model, emulated runs, chaos);
* ``eval/``: whether Miles' scoring agrees with the datasets' own harnesses.

Each runs as ``python -m benchmarks.NAME`` (the folders are on this package's search path, so a
module's name does not say its folder, and a benchmark can move between folders without renaming a
command), prints a table, writes ``benchmarks/results/NAME.json`` (outputs, never committed) and has
``--smoke``, which benchmarks/tests/test_smoke.py runs in CI. ``harness`` is what the benchmarks
share; the modules in ``HELPERS`` are pieces one benchmark family shares, not benchmarks. Fixtures
and references that tests use too live in ``tools/``: nothing in ``tests/`` imports this package."""

from pathlib import Path

FOLDERS = ("learn", "speed", "scale", "eval")
__path__ += [str(Path(__file__).parent / folder) for folder in FOLDERS]

HELPERS = {
    "harness": "arguments, SFT checkpoints, seeds in processes, paired tests, result files",
    "real_model_decode": "real_model's decoding measurements (latency, NSD FLOPs, the AR original)",
    "sim": "the discrete-event model scale_model runs",
    "update_pace": "sim's update time on D ranks: shares in units of the deal, the slowest rank, the all-reduce",
    "model_fit": "scale_model against the emulated runs: calibration, out-of-sample and straggler predictions",
    "standin": "emulate's calibrated compute stand-in process (python -m benchmarks.standin sampler|learner)",
}
