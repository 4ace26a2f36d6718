"""Progress output: plain, periodic lines (count, ETA, live figures) when the stream is not a
terminal, never tqdm's carriage-return updates."""

from __future__ import annotations

import io

from miles_core.progress import Progress, track


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress(4, "rl", every_s=0.0, stream=out) as bar:
        for k in range(4):
            bar.update(1, reward=0.25 * k, **{"pass@1": 0.5})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 4
    assert lines[0].startswith("rl 1/4 (25%) ") and "ETA " in lines[0] and lines[0].endswith("reward 0.000, pass@1 0.500")
    assert lines[-1].startswith("rl 4/4 (100%) ") and "ETA 0:00" in lines[-1]


def test_rate_limited_and_silent_when_disabled() -> None:
    out = io.StringIO()
    with Progress(1000, "sft", every_s=3600.0, stream=out) as bar:
        for _ in range(1000):
            bar.update()
    assert len(out.getvalue().splitlines()) == 2  # the first update and the last, not 1000
    quiet = io.StringIO()
    with Progress(5, "x", enabled=False, stream=quiet) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""
    assert list(track(range(3), 3, "t", enabled=False)) == [0, 1, 2]
