"""Every benchmark at its smoke size, as CI runs it: what ``python -m benchmarks.NAME --smoke`` runs
(``main(["--smoke"])``), which must return and write ``NAME_smoke.json`` holding ``"smoke": true`` (each benchmark
checks its own invariants before writing: ``benchmarks/harness.py::check_measured``). A module under
``benchmarks/`` that is neither a benchmark with a smoke mode nor a listed helper fails here, and a
benchmark whose measurement is bypassed fails its own run (the rollout wrapper case below).

The lane alone: ``pytest -m bench -n 3 --dist loadfile benchmarks/tests`` (three files of smoke runs
side by side; their processes mostly wait, so three workers share two cores)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks import HELPERS

ROOT = Path(__file__).resolve().parents[2]
# every module on the package's search path (benchmarks/ and its folders): name -> file
FILES = {p.stem: p for folder in benchmarks.__path__ for p in Path(folder).glob("*.py") if p.stem != "__init__"}
MODULES = sorted(FILES)
BENCHMARKS = [m for m in MODULES if m not in HELPERS]
# Benchmarks whose smoke run is a test of its own, with more checks (so the lane runs it once).
OWN_TEST = {"real_model": "benchmarks/tests/test_real_model.py"}
# The lane in three files of about equal time, so pytest workers (--dist loadfile) finish them
# together: the benchmarks below in test_smoke_lane2.py and test_smoke_lane3.py, the rest here
# (a benchmark added later lands here). Seconds each file took in the lane on 2 quiet cores
# (-n 3, 2026-12-07, 245 s in all): lane 2 ~226; lane 3 ~180, after test_real_model.py's ~51 on
# the same worker (loadfile hands the fourth file to the first worker free); here ~227.
LANE2 = ["async_vs_sync", "code", "estimators", "grad_snr", "learner_ranks", "learning", "nsd", "refresh"]
LANE3 = ["chaos", "emulate", "fixed_batch", "run_age", "scale_model", "scaling", "sft_ceiling", "step_merge"]
OTHERS = [m for m in BENCHMARKS if m not in OWN_TEST and m not in LANE2 and m not in LANE3]


def test_module_names_are_unique_across_the_folders() -> None:
    """Two folders holding one name would make ``python -m benchmarks.NAME`` run whichever folder
    comes first on the search path."""
    stems = [p.stem for folder in benchmarks.__path__ for p in Path(folder).glob("*.py") if p.stem != "__init__"]
    assert len(stems) == len(set(stems)), sorted(s for s in set(stems) if stems.count(s) > 1)


def test_every_module_is_a_benchmark_with_a_smoke_mode_or_a_helper() -> None:
    assert set(HELPERS) <= set(MODULES), sorted(set(HELPERS) - set(MODULES))
    for name in BENCHMARKS:
        rel = FILES[name].relative_to(ROOT)
        src = FILES[name].read_text()
        assert 'if __name__ == "__main__"' in src, f"{rel} runs as nothing: a benchmark or a HELPERS entry"
        assert "add_smoke(" in src or "bench_args(" in src, f"{rel} has no --smoke (harness.add_smoke)"
        assert "def main(argv: list[str] | None = None)" in src, f"{rel}: main must take argv"
    for name, test in OWN_TEST.items():
        assert "--smoke" in (ROOT / test).read_text() and "pytest.mark.bench" in (ROOT / test).read_text(), test


def run_smoke(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``main(["--smoke", ...])`` in this process (what ``python -m benchmarks.NAME --smoke`` runs;
    in-process so the lane pays the imports once: 27 fresh interpreters would spend ~2 minutes
    importing torch and transformers alone)."""
    monkeypatch.setenv("MILES_BENCH_RESULTS", str(tmp_path / "results"))
    # processes a benchmark starts (a forkserver's preloads, torchrun) import benchmarks.* from the
    # repository, as they do under `python -m benchmarks.NAME` run from its root
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    module = importlib.import_module(f"benchmarks.{name}")
    try:
        module.main(["--smoke"])
    finally:
        torch.set_num_threads(threads)
    written = sorted((tmp_path / "results").glob("*_smoke.json"))
    assert written, f"benchmarks.{name} --smoke wrote no *_smoke.json"
    for path in written:
        assert json.loads(path.read_text()).get("smoke") is True, path


def lane(names: list[str]):
    """The smoke test of ``names``, one parametrized case each: this file's, test_smoke_lane2.py's
    and test_smoke_lane3.py's (three files so --dist loadfile puts them on three workers)."""

    @pytest.mark.e2e
    @pytest.mark.bench
    @pytest.mark.parametrize("name", names)
    def test_smoke(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        run_smoke(name, tmp_path, monkeypatch)
    return test_smoke


test_smoke = lane(OTHERS)


class _PlainWrapper(torch.nn.Module):
    """benchmarks/speed/rollout.py's timing wrapper as it once was: a plain module, so
    the sampler saw the default capabilities and never called its window."""

    def __init__(self, model, width: int, block: int, blocks: int) -> None:
        super().__init__()
        self.model, self.calls, self.cache_calls = model, 0, 0

    def window(self, ids, mask, query, out, cache=None, keep=()):
        self.calls += 1
        return self.model.window(ids, mask, query, out, cache, keep)

    def forward(self, ids, mask=None):
        return self.model(ids, mask)


@pytest.mark.e2e
@pytest.mark.bench
@pytest.mark.parametrize("bypass", ["plain_wrapper", "capabilities_lost"])
def test_rollout_fails_when_its_wrapper_bypasses_the_engine(bypass: str, monkeypatch, tmp_path: Path) -> None:
    """A timing wrapper the sampler does not see as the model must fail
    the run, not publish a speedup. A plain module's window is never called (0 calls: measured
    nothing); a wrapper without the model's capabilities is refused a cache by the sampler."""
    import benchmarks.rollout as rollout
    from benchmarks.harness import MeasuredNothing
    from miles_core.config.schema import ConfigError
    from miles_core.models.window import Capabilities

    monkeypatch.setenv("MILES_BENCH_RESULTS", str(tmp_path))
    if bypass == "plain_wrapper":
        monkeypatch.setattr(rollout, "FirstBlocks", _PlainWrapper)
    else:
        monkeypatch.setattr(rollout.FirstBlocks, "capabilities", lambda self: Capabilities())
    with pytest.raises(MeasuredNothing if bypass == "plain_wrapper" else ConfigError):
        rollout.main(["--smoke"])
    assert not list(tmp_path.glob("*.json"))


def test_the_three_parts_of_the_lane_run_every_benchmark_once() -> None:
    assert sorted(LANE2 + LANE3 + OTHERS + list(OWN_TEST)) == BENCHMARKS
    assert len(set(LANE2) | set(LANE3) | set(OTHERS)) == len(LANE2) + len(LANE3) + len(OTHERS)
    assert "estimators" in LANE2 and "emulate" in LANE3 and "rollout" in OTHERS
