"""A sampler worker: load the base once, hot-swap LoRA versions, sample groups, commit batches.

The loop, per batch:

    take the batch's slot k of the run's sample budget (its own stripe, or a claimed slot)
    wait until the learner's version v admits it: k < (S + v + 1) x B + the batches it passed without
        an update (learner/channels.py), reading only ``adapters/LATEST`` (and ``control/STOP``) per
        poll, with back-off
    load the newest published adapter if it changed (LoRA tensors only: the base stays put)
    sample prompts_per_iter prompts x G completions, score rewards, group advantages (with
        ``async_rl.refresh_every``, newer adapters swapped in between steps: asyncrl/refresh.py)
    commit the batch as ``{seq:06d}-{worker}`` tagged with the adapter version that sampled it

Why admission instead of dropping stale batches at the learner: a finished rollout dropped for
staleness is wasted compute and biases the data toward short rollouts; admitting work only when
its result will be fresh enough keeps drops at zero in steady state. And why a version pointer:
it is one small object whatever the fleet, so polls cost the same per committed batch from 1 to
4,096 samplers (the learner versions once per B sampler batches, ``async_rl.global_batch``).

Restart safety: batch ids are deterministic and each batch's randomness is seeded from (run seed,
worker, seq), so a killed sampler resumes at its first uncommitted sequence number; a batch it
was writing when killed was never visible (commit marker last) and is simply written again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles_core.algo.rl import batch_id, rollout_stats, sample_batch
from miles_core.allocator import apply_heap_setting
from miles_core.asyncrl.refresh import InFlightRefresh
from miles_core.config import load_recipe
from miles_core.data.registry import build_task
from miles_core.learner.channels import BatchChannel, PolicyChannel, poll_intervals, uses_inbox
from miles_core.learner.policy import build_policy
from miles_core.rewards.registry import reward_for_recipe
from miles_core.storage.run import RunStore

log = logging.getLogger(__name__)


class SamplerWorker:
    """One sampler process. ``run()`` returns its final status (also written to the store)."""

    def __init__(self, run_uri: str, worker: str, worker_index: int = 0, cache_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        if worker == "learner" or worker.endswith("-learner"):
            raise ValueError(f"sampler worker name {worker!r} is reserved for the learner's own batches")
        self.run_store = RunStore(run_uri, storage_options)
        spec = self.run_store.read_spec()
        self.cfg = load_recipe(spec["cfg"])
        self.run_store.retry_budget_s = self.cfg.async_rl.retry_budget_s
        self.batches = BatchChannel(self.run_store, self.cfg, inbox=uses_inbox(spec))
        self.policy = PolicyChannel(self.run_store)
        torch.set_num_threads(self.cfg.async_rl.sampler_threads)
        apply_heap_setting(self.cfg.async_rl.retain_heap_mb)  # a sampler only samples: else every step faults in fresh pages
        if self.cfg.async_rl.sampler_nice > 0:  # samplers and learner share cores: let the learner go first
            os.nice(self.cfg.async_rl.sampler_nice)
        if self.cfg.async_rl.pin_samplers and hasattr(os, "sched_setaffinity"):
            # Without pinning, the scheduler balances *weighted* load: two niced samplers weigh less than
            # one learner, so both land on one core and the learner's core idles whenever it waits.
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpus[worker_index % len(cpus)]})
        self.worker, self.index = worker, worker_index
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix=f"miles-sampler-{worker}-"))
        self.owns_cache = cache_dir is None  # a temp folder of its own: removed when the run ends
        base_dir = self.run_store.fetch_base(self.cache)
        self.model, self.tok = build_policy(self.cfg, base_dir, trainable=False)  # once; only LoRA tensors change later
        self.base_ptr = next(iter(self.model.get_base_model().parameters())).data_ptr()
        self.data = build_task(self.cfg)
        self.reward_fn = reward_for_recipe(self.cfg)
        self.version: int | None = None
        self.span = 0  # versions the last rollout advanced by (in-flight refresh)
        self._latest: int | None = None  # the version the last admission poll read
        self._passed = 0                 # and the batches the learner had passed without an update
        prev = self.run_store.read_json("samplers", f"{worker}.json") or {}
        self.stats: dict[str, Any] = {"worker": worker, "committed": prev.get("committed", 0),
                                      "next_seq": prev.get("next_seq", 0), "sync_bytes": prev.get("sync_bytes", 0),
                                      "syncs": prev.get("syncs", 0), "sync_seconds": prev.get("sync_seconds", 0.0),
                                      "sync_lag_seconds": prev.get("sync_lag_seconds", []), "busy_s": 0.0,
                                      "sample_s": 0.0, "commit_s": 0.0,
                                      "wait_s": 0.0, "startup_wait_s": 0.0, "restarts": prev.get("restarts", -1) + 1, "done": False}

    # ------------------------------------------------------------------ adapter hot-swap
    def sync_adapter(self, latest: int | None = None) -> bool:
        """Load adapter ``latest`` (default: the newest published) into the resident model if it
        is not the one loaded; True if swapped."""
        if latest is None:
            latest = self.policy.latest()
        if latest is None or latest == self.version:
            return False
        t0 = time.perf_counter()
        dest = self.cache / f"adapter-v{latest:06d}"
        with self.run_store.requests.phase("sync"):
            manifest = self.policy.load_into(self.model, latest, dest)
        assert next(iter(self.model.get_base_model().parameters())).data_ptr() == self.base_ptr
        nbytes = sum(int(f["bytes"]) for f in manifest["files"].values())
        published = manifest.get("metadata", {}).get("published_unix")
        self.stats["sync_bytes"] += nbytes
        self.stats["syncs"] += 1
        self.stats["sync_seconds"] += time.perf_counter() - t0
        if published is not None:
            self.stats["sync_lag_seconds"] = (self.stats["sync_lag_seconds"] + [time.time() - float(published)])[-200:]
        for old in self.cache.glob("adapter-v*"):
            if old != dest:
                shutil.rmtree(old, ignore_errors=True)
        self.version = latest
        return True

    # ------------------------------------------------------------------ admission
    def learner_version(self) -> int | None:
        """The newest published adapter version (``adapters/LATEST``: one small read)."""
        self.stats["polls"] = self.stats.get("polls", 0) + 1
        self._latest, self._passed = self.policy.admission()
        return self._latest

    def admitted(self, slot: int) -> bool:
        """Whether the learner's version now admits batch slot ``slot`` (``BatchChannel.admits``)."""
        v = self.learner_version()
        return v is not None and self.batches.admits(slot, v, self._passed)

    def _wait(self, cond, poll: float, key: str = "wait_s") -> bool:
        """Sleep until ``cond()``, each empty poll waiting ``async_rl.poll_backoff`` times longer (up
        to ``poll_max_interval``); False if a stop was requested meanwhile. The time waited adds to
        ``stats[key]``: ``wait_s`` (admission) or ``startup_wait_s`` (for the first adapter)."""
        a = self.cfg.async_rl
        t0 = time.perf_counter()
        try:
            for interval in poll_intervals(poll, a.poll_backoff, a.poll_max_interval):
                if self.run_store.stop_requested():  # first: a sampler that never waits must stop too
                    return False
                if cond():
                    return True
                time.sleep(interval)
            return True
        finally:
            self.stats[key] += time.perf_counter() - t0

    # ------------------------------------------------------------------ one batch
    def make_batch(self, seq: int):
        """Sample and score batch ``seq`` with the resident adapter (prompts and noise deterministic
        in run seed, worker, seq); with ``async_rl.refresh_every``, newer adapters are swapped in
        between its steps as they are published (asyncrl/refresh.py)."""
        a = self.cfg.async_rl
        if not a.refresh_every:
            return sample_batch(self.cfg, self.model, self.tok, self.data, self.reward_fn, self.worker, self.index,
                                seq, int(self.version or 0))
        with InFlightRefresh(self.policy, self.model, int(self.version or 0), a.refresh_every, self.cache,
                             (a.poll_interval, a.poll_backoff, a.poll_max_interval)) as refresh:
            batch = sample_batch(self.cfg, self.model, self.tok, self.data, self.reward_fn, self.worker, self.index,
                                 seq, int(self.version or 0), refresh=refresh)
        self.version, self.span = refresh.version, refresh.span
        st = self.stats
        st["refreshes"] = st.get("refreshes", 0) + refresh.swaps
        st["sync_bytes"] += refresh.fetched_bytes
        st["refresh_lag_s"] = (st.get("refresh_lag_s", []) + refresh.lag_s)[-200:]
        st["refresh_span"] = refresh.span  # updates the last rollout spanned
        return batch

    def run(self) -> dict[str, Any]:
        a = self.cfg.async_rl
        rs = self.run_store
        quarantined = set(rs.retry(rs.trajectories.list_quarantined, "listing quarantine"))
        req = rs.requests  # what each protocol step costs on the wire (status: request_steps)
        with req.phase("startup_wait"):  # for the learner's first version
            if not self._wait(lambda: self.learner_version() is not None, a.poll_interval, "startup_wait_s"):
                return self._finish(stopped=True)
        self.stats["requests_at_start"] = req.total()  # the spec, the base, the wait for version 0
        seq = int(self.stats["next_seq"])
        stripe = a.num_samplers  # a self-sampling learner takes the lowest free slot, no stripe of its own
        claims = self.batches.claims
        mine = claims.own(self.worker) if a.shared_budget else {}
        while a.shared_budget or seq < a.batches_per_sampler:
            bid = batch_id(seq, self.worker)
            if bid in quarantined:
                seq += 1
                continue
            if not a.shared_budget:
                slot: int | None = seq * a.num_samplers + self.index
            elif bid in mine:
                slot = mine[bid]
            else:  # its own stripe first: index, index + stripe, ... (one request when nobody took it)
                with req.phase("claim"):
                    slot = claims.claim(bid, prefer=self.index + stripe * len(mine))
                if slot is None:
                    break  # every slot of the run's budget is taken
                mine[bid] = slot
            polls = self.stats.get("polls", 0)
            with req.phase("wait"):
                admitted = self._wait(lambda: self.admitted(slot), a.poll_interval)
            self.stats["admission_polls"] = self.stats.get("admission_polls", 0) + self.stats["polls"] - polls
            if not admitted:
                return self._finish(stopped=True, next_seq=seq)
            t0 = time.perf_counter()
            self.sync_adapter(self._latest)
            t1 = time.perf_counter()
            batch = self.make_batch(seq)
            t2 = time.perf_counter()
            with req.phase("commit"):  # a commit that landed before a restart (stats not yet written) counts
                committed = self.batches.commit(batch, bid)
            if committed:
                self.stats["committed"] += 1
            else:
                log.info("batch %s was already committed; skipping", bid)
            seq += 1
            t3 = time.perf_counter()
            self.stats["busy_s"] += t3 - t0
            self.stats["sample_s"] += t2 - t1  # rollout + reward alone
            self.stats["commit_s"] += t3 - t2
            self.stats.update(next_seq=seq, version=self.version, last=rollout_stats(batch), slot=slot,
                              **req.report())
            with req.phase("status"):
                rs.write_json(self.stats, "samplers", f"{self.worker}.json")
        return self._finish(stopped=False, next_seq=seq)

    def _finish(self, stopped: bool, next_seq: int | None = None) -> dict[str, Any]:
        if next_seq is not None:
            self.stats["next_seq"] = next_seq
        self.stats.update(done=not stopped, stopped=stopped, **self.run_store.requests.report())
        self.run_store.write_json(self.stats, "samplers", f"{self.worker}.json")
        if self.owns_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
        return self.stats
