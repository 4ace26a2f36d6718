"""A third of the smoke lane of test_smoke.py (which lists every benchmark, checks each has a smoke
mode and says which runs where), in a file of its own so another pytest worker runs it beside the first."""

from __future__ import annotations

from benchmarks.tests.test_smoke import LANE3, lane

test_smoke = lane(LANE3)
