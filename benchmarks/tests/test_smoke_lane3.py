"""The scale benchmarks' smoke runs: a third of the lane of test_smoke.py (which lists
every benchmark and checks each has a smoke mode), in a file of its own so another pytest worker
runs it beside the first."""

from __future__ import annotations

from benchmarks.tests.test_smoke import SCALE, lane

test_smoke = lane(SCALE)
