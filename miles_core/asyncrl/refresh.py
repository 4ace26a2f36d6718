"""In-flight policy refresh for a sampler: the next adapter is fetched while a rollout runs and
swapped in between two denoising steps, instead of at the next rollout.

Why between steps: a diffusion rollout is K separate denoiser calls, each of which the sampler
already records with its own behaviour log-probs, so a step boundary is a natural place to change
policy with nothing to recompute (PipelineRL's in-flight weight updates, Piché et al. 2025, swap
weights between the tokens of running generations for the same reason). A rollout that spans
several learner updates then samples its late steps with a fresh adapter, and the learner weighs
each recorded step by the log-prob of the adapter that took it, as it always does.

How: a background thread polls ``adapters/LATEST`` (with the run's back-off) and, when it names a
newer version, fetches its files and loads its tensors into host memory; the sampling thread, at
every ``async_rl.refresh_every``-th step boundary, copies the newest fetched tensors into the
resident peft model (LoRA tensors only; the base stays put). Only the sampling thread touches the
model, so a step never sees half an adapter.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from miles_core.learner.channels import PolicyChannel, poll_intervals


class InFlightRefresh:
    """A :class:`~miles_core.samplers.sampler.Refresh` for one rollout (``with`` starts and stops its
    fetcher): the model holds adapter ``loaded``; ``every``: swap at every ``every``-th step;
    ``poll``: (first, back-off, cap) seconds between polls of ``adapters/LATEST``; ``cache``: where
    fetched adapter files go. After the rollout, ``version`` is the adapter the model holds and
    ``swaps`` / ``fetched_bytes`` / ``lag_s`` say what it did."""

    def __init__(self, policy: PolicyChannel, model: nn.Module, loaded: int, every: int, cache: Path,
                 poll: tuple[float, float, float]) -> None:
        if every < 1:
            raise ValueError(f"async_rl.refresh_every={every}: an in-flight refresh swaps every >= 1 steps")
        self.policy, self.model, self.every, self.cache, self.poll = policy, model, every, cache, poll
        self.version = self.started = loaded
        self.swaps, self.fetched_bytes = 0, 0
        self.lag_s: list[float] = []   # fetched -> swapped in, per swap
        self._ready: tuple[int, dict[str, Tensor], float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> "InFlightRefresh":
        self._thread = threading.Thread(target=self._fetch_loop, name="miles-refresh", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"in-flight refresh failed fetching an adapter: {self.error}") from self.error

    def _fetch_loop(self) -> None:
        """Poll LATEST; fetch each newer version into memory (the newest wins; older ones are dropped)."""
        first, backoff, cap = self.poll
        try:
            while not self._stop.is_set():
                for interval in poll_intervals(first, backoff, cap):
                    latest = self.policy.latest()
                    with self._lock:
                        have = max(self.version, self._ready[0] if self._ready else -1)
                    if latest is not None and latest > have:
                        break
                    if self._stop.wait(interval):
                        return
                dest = self.cache / f"inflight-v{latest:06d}"
                state, manifest = self.policy.fetch(latest, dest)
                shutil.rmtree(dest, ignore_errors=True)  # the tensors are in memory now
                self.fetched_bytes += sum(int(f["bytes"]) for f in manifest["files"].values())
                with self._lock:
                    self._ready = (latest, state, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - surfaced by __exit__ on the sampling thread
            self.error = e

    def __call__(self, forwards: int) -> int | None:
        """Between two forwards: swap in the newest fetched adapter at every ``every``-th step."""
        if forwards % self.every:
            return None
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None or ready[0] <= self.version:
            return None
        version, state, fetched_at = ready
        PolicyChannel.apply(self.model, version, state)
        self.lag_s.append(time.perf_counter() - fetched_at)
        self.version, self.swaps = version, self.swaps + 1
        return version

    @property
    def span(self) -> int:
        """Versions the rollout advanced by: how many updates it spanned."""
        return self.version - self.started
