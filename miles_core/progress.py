"""Progress over long loops: a tqdm bar (ETA, live figures) on a terminal, plain lines elsewhere.

tqdm writes a carriage-return update many times a second; in a log file or CI that is thousands of
``\\r`` fragments. When the stream is not a terminal, :class:`Progress` prints one plain line at
most every ``every_s`` seconds (and at the end) instead, with the same count, ETA and figures.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """``with Progress(total, "rl") as bar: ... bar.update(1, reward=0.4)``."""

    def __init__(self, total: int, desc: str, enabled: bool = True, every_s: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self.total, self.desc, self.every_s = int(total), desc, every_s
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.total > 0
        self.done, self.t0, self.last = 0, time.monotonic(), float("-inf")
        self.figures: dict[str, Any] = {}
        self.bar = None
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=desc, leave=False, file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1, **figures: Any) -> None:
        self.done += n
        self.figures.update(figures)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix({k: _fmt(v) for k, v in self.figures.items()}, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        """``rl 12/40 (30%) 0:48 elapsed, ETA 1:52, reward 0.412`` (a plain progress line)."""
        el = (now if now is not None else time.monotonic()) - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        figs = "".join(f", {k} {_fmt(v)}" for k, v in self.figures.items())
        pct = 100 * self.done // max(self.total, 1)
        return (f"{self.desc} {self.done}/{self.total} ({pct}%) {_clock(el)} elapsed, "
                f"ETA {_clock(eta) if eta == eta else '?'}{figs}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def track(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """``for x in track(xs, len(xs), "sft")``: a Progress ticking once per item."""
    with Progress(total, desc, enabled) as bar:
        for x in items:
            yield x
            bar.update(1)
