"""Count the S3 requests a process sends, by operation (PutObject, GetObject, HeadObject ...).

Why: on object storage the cost and the latency of the commit protocol are its round trips, so
runs report "store requests per committed batch" in their status files. Counting happens in
botocore's event system (``before-send``, fired once per HTTP request, retries included), so it
sees exactly what goes on the wire and needs no change to the stores.

A local folder makes system calls, not requests: :meth:`RequestCounter.attach` then attaches
nothing, returns False, and :attr:`RequestCounter.note` says why.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fsspec import AbstractFileSystem

from miles_core.storage import uri as U

_EVENT = "before-send.s3"  # botocore events are hierarchical: this matches before-send.s3.<Operation>


class RequestCounter:
    """Thread-safe counts of S3 requests by operation name, for one or more s3fs filesystems.

    ``counter.attach(store.fs)`` then ``counter.snapshot()`` -> ``{"PutObject": 2, ...}``.
    s3fs creates one botocore client per filesystem (per bucket only with ``cache_regions``, whose
    extra clients are not seen); attaching the same client twice counts it once.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._clients: set[int] = set()
        self._phases: dict[str, tuple[int, int]] = {}
        self.note = "not attached to any filesystem"

    def attach(self, fs: AbstractFileSystem) -> bool:
        """Count requests ``fs`` sends from now on; False (and nothing attached) when ``fs`` is
        not an S3 filesystem. Connects an s3fs filesystem that has not made a request yet."""
        if U.is_local(fs):
            self.note = "local filesystem: no requests to count"
            return False
        client = getattr(fs, "s3", None)  # s3fs: the aiobotocore client, created on first use
        events = getattr(getattr(client, "meta", None), "events", None)
        if events is None:
            self.note = f"{type(fs).__name__} has no botocore client: requests not counted"
            return False
        if id(client) not in self._clients:
            self._clients.add(id(client))
            events.register(_EVENT, self._on_send, unique_id=f"miles-request-counter-{id(self)}")
        self.note = "counting S3 requests"
        return True

    def _on_send(self, event_name: str = "", **kwargs: Any) -> None:
        """Record one request. Must return None: a before-send handler's return value would be
        taken as the response and the request never sent."""
        operation = event_name.rsplit(".", 1)[-1] if event_name.count(".") >= 2 else "unknown"
        with self._lock:
            self._counts[operation] += 1

    def snapshot(self) -> dict[str, int]:
        """Counts so far, by operation, sorted by name (a copy: later requests do not change it)."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def total(self) -> int:
        """All requests counted so far."""
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> None:
        """Start counting from zero (attached clients stay attached)."""
        with self._lock:
            self._counts.clear()
            self._phases.clear()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the requests sent inside the block to protocol step ``name``, once per entry:
        :meth:`phases` then says what each step costs on the wire (benchmarks/scale/sim.py models the
        store with these per-step costs)."""
        before = self.total()
        try:
            yield
        finally:
            sent = self.total() - before
            with self._lock:
                n, times = self._phases.get(name, (0, 0))
                self._phases[name] = (n + sent, times + 1)

    def report(self) -> dict[str, Any]:
        """What a process's status file records of its traffic: requests by operation, by step."""
        return {"requests": self.snapshot(), "request_steps": self.phases()}

    def phases(self) -> dict[str, dict[str, int]]:
        """``{step: {"requests": n, "times": entries}}`` for every :meth:`phase` entered so far."""
        with self._lock:
            return {k: {"requests": n, "times": t} for k, (n, t) in sorted(self._phases.items())}


# One counter per process: what a run reports in its status file.
PROCESS = RequestCounter()
