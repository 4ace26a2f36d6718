"""The scale benchmarks' smoke runs: a third of the lane of test_smoke.py (which lists
every benchmark and checks each has a smoke mode), in a file of its own so another pytest worker
runs it beside the first."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.tests.test_smoke import SCALE, run_smoke


@pytest.mark.e2e
@pytest.mark.bench
@pytest.mark.parametrize("name", SCALE)
def test_smoke(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_smoke(name, tmp_path, monkeypatch)
