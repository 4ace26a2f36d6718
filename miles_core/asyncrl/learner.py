"""The asynchronous learner: consume committed batches, enforce staleness, update, publish.

The loop, per batch (oldest first):

    read the batch (a corrupt one is quarantined and recorded, never fatal)
    staleness s = current version - the batch's policy version; s > S: drop it and record it
    ADPO update with the truncated importance weight against the stored behaviour log-probs
    version += 1; checkpoint every N updates; publish the adapter; write status.json

and when no batch is waiting: with ``async_rl.learner_samples`` it claims a slot of the shared
sample budget and samples that batch itself with the current policy (committed like any sampler's,
so the ledger and restarts treat it the same), else it sleeps and the wait counts as idle.

Exactly-once: the *ledger* (which batch ids were consumed, dropped or quarantined) lives inside
the learner checkpoint, next to the adapter and optimizer it produced, and both are written in
one atomic object. A learner killed after an update but before its checkpoint resumes from the
previous checkpoint, whose ledger does not list that batch, so the batch is used again by the
surviving lineage and exactly once there. Adapter versions the dead learner published after its
last checkpoint are orphaned: the resumed learner numbers its next version above them, so a
number is never reused for different weights.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from miles_core.asyncrl.layout import RunStore
from miles_core.asyncrl.sampler import SlotClaims, batch_id, batch_seq, sample_batch
from miles_core.config import load_recipe
from miles_core.session import Learner, build_task
from miles_core.storage import BatchExistsError, CorruptBatchError

log = logging.getLogger(__name__)
SELF = "learner"  # the worker name of batches the learner samples itself


class AsyncLearner:
    """The single learner process of an asynchronous run. ``run()`` returns its final status."""

    def __init__(self, run_uri: str, cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                 max_updates: int | None = None) -> None:
        self.rs = RunStore(run_uri, storage_options)
        spec = self.rs.read_spec()
        self.cfg = load_recipe(spec["cfg"])
        self.rs.retry_budget_s = self.cfg.async_rl.retry_budget_s
        torch.set_num_threads(self.cfg.async_rl.learner_threads)
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix="miles-learner-"))
        self.owns_cache = cache_dir is None  # a temp folder of its own: removed when the run ends
        base_dir = self.rs.fetch_base(self.cache)
        # one update per batch: the LR schedule spans the run's batch budget
        self.learner = Learner(self.cfg, base_dir, seed=self.cfg.train.seed, total_updates=self.expected)
        self.max_updates = max_updates  # stop after this many updates in this process (tests, chaos)
        self.ledger: dict[str, list[dict[str, Any]]] = {"consumed": [], "dropped": [], "quarantined": []}
        self.history: list[dict[str, Any]] = []
        self.totals = {"idle_s": 0.0, "wall_s": 0.0, "fill_s": 0.0, "resumes": 0, "version_skips": 0}
        ckpt = self.rs.load_checkpoint()
        if ckpt is not None:
            self.learner.load_state(ckpt["learner"])
            self.ledger, self.history, self.totals = ckpt["ledger"], ckpt["history"], ckpt["totals"]
            self.totals["resumes"] += 1
        latest = self.rs.retry(self.rs.adapters.latest_version, "polling adapters")
        if latest is not None and latest > self.learner.version:
            # versions published after the last checkpoint by a learner that died: never reuse them
            log.warning("resuming at checkpoint version %d below published %d; next version is %d",
                        self.learner.version, latest, latest + 1)
            self.learner.version = latest
            self.totals["version_skips"] += 1
        self._since_ckpt = 0
        self._init_self_sampling()
        if not self.rs.retry(lambda: self.rs.adapters.is_committed(self.learner.version), "checking adapter"):
            self.publish()

    # ------------------------------------------------------------------ sampling instead of waiting
    def _init_self_sampling(self) -> None:
        a = self.cfg.async_rl
        self.claims = SlotClaims(self.rs, self.expected) if a.learner_samples else None
        self._redo: list[str] = []
        self._next_seq = 0
        if self.claims is None:
            return
        self.data = build_task(self.cfg)
        mine = self.claims.own(SELF)
        committed = set(self.rs.retry(self.rs.trajectories.list_batches, "listing trajectories"))
        quarantined = set(self.rs.retry(self.rs.trajectories.list_quarantined, "listing quarantine"))
        # claimed, then killed before the commit: redo those first (never one already handled or quarantined)
        self._redo = sorted(mine - committed - quarantined - self.handled())
        self._next_seq = 1 + max((batch_seq(b) for b in mine), default=-1)

    def sample_self(self) -> bool:
        """Sample one batch of the shared budget with the current policy; False once the budget is claimed."""
        if self.claims is None:
            return False
        if self._redo:
            bid = self._redo.pop(0)
        else:
            bid = batch_id(self._next_seq, SELF)
            if not self.claims.claim(bid):
                self.claims = None  # every slot is taken: from now on only wait for the samplers' batches
                return False
            self._next_seq += 1
        t0 = time.perf_counter()
        lrn = self.learner
        batch = sample_batch(self.cfg, lrn.model, lrn.tok, self.data, lrn.reward_fn, SELF,
                             self.cfg.async_rl.num_samplers, batch_seq(bid), lrn.version)
        try:
            self.rs.retry(lambda: self.rs.trajectories.write_batch(batch, batch_id=bid), f"committing batch {bid}")
        except BatchExistsError:
            log.info("batch %s was already committed; skipping", bid)
        self.totals["sample_s"] = self.totals.get("sample_s", 0.0) + time.perf_counter() - t0  # rollout + commit
        self.totals["self_batches"] = self.totals.get("self_batches", 0) + 1
        return True

    # ------------------------------------------------------------------ bookkeeping
    def handled(self) -> set[str]:
        return {e["id"] for entries in self.ledger.values() for e in entries}

    @property
    def expected(self) -> int:
        return self.cfg.async_rl.num_samplers * self.cfg.async_rl.batches_per_sampler

    def status(self, done: bool = False) -> dict[str, Any]:
        st = [e["staleness"] for e in self.ledger["consumed"]]
        wall = max(self.totals["wall_s"], 1e-9)
        return {"version": self.learner.version, "updates": len(self.ledger["consumed"]),
                "consumed": len(self.ledger["consumed"]), "dropped": len(self.ledger["dropped"]),
                "quarantined": len(self.ledger["quarantined"]), "expected": self.expected, "done": done,
                "staleness_hist": {str(k): v for k, v in sorted(Counter(st).items())},
                "max_staleness_seen": max(st, default=0), "staleness_bound": self.cfg.adpo.max_staleness,
                "idle_s": self.totals["idle_s"], "wall_s": self.totals["wall_s"],
                "idle_fraction": self.totals["idle_s"] / wall, "resumes": self.totals["resumes"],
                # idle after the first batch arrived: the pipeline-fill wait at start-up excluded
                "fill_s": self.totals.get("fill_s", 0.0),
                "idle_fraction_steady": (self.totals["idle_s"] - self.totals.get("fill_s", 0.0))
                / max(wall - self.totals.get("fill_s", 0.0), 1e-9),
                "version_skips": self.totals["version_skips"],
                # batches the learner sampled itself instead of waiting (async_rl.learner_samples)
                "self_sampled_batches": self.totals.get("self_batches", 0),
                "self_sample_s": self.totals.get("sample_s", 0.0),
                "self_sample_fraction": self.totals.get("sample_s", 0.0) / wall,
                "completions": sum(e["rows"] for e in self.ledger["consumed"])}

    def checkpoint(self) -> None:
        blob = {"learner": self.learner.state(), "ledger": self.ledger, "history": self.history,
                "totals": self.totals, "version": self.learner.version}
        self.rs.save_checkpoint(blob, self.learner.version)
        self._since_ckpt = 0

    def publish(self) -> None:
        """Upload the current adapter as version ``learner.version`` (idempotent on resume)."""
        v = self.learner.version
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            self.learner.save_adapter(tmp, getattr(torch, self.cfg.async_rl.sync_dtype))
            self.rs.retry(lambda: self.rs.adapters.is_committed(v) or
                          self.rs.adapters.publish(tmp, version=v, metadata={"published_unix": time.time()}),
                          f"publishing adapter v{v}")

    # ------------------------------------------------------------------ the loop
    def step(self, bid: str) -> str:
        """Handle one committed batch: 'consumed', 'dropped' or 'quarantined'."""
        rs, S = self.rs, self.cfg.adpo.max_staleness
        t_read = time.perf_counter()
        try:
            batch = rs.retry(lambda: rs.trajectories.read_batch(bid), f"reading batch {bid}")
        except CorruptBatchError as e:
            rs.retry(lambda: rs.trajectories.quarantine(bid, str(e)), f"quarantining {bid}")
            self.ledger["quarantined"].append({"id": bid, "reason": str(e)[:300]})
            return "quarantined"
        behaviour_version = int(batch.policy_version.min())
        staleness = self.learner.version - behaviour_version
        if staleness > S:
            self.ledger["dropped"].append({"id": bid, "staleness": staleness})
            return "dropped"
        t0 = time.perf_counter()
        stats = self.learner.update(batch)
        t1 = time.perf_counter()
        reward = torch.nan_to_num(batch.reward, nan=0.0)
        self.ledger["consumed"].append({"id": bid, "staleness": staleness, "policy_version": behaviour_version,
                                        "learner_version": self.learner.version, "rows": len(batch)})
        self.history.append({"update": len(self.ledger["consumed"]), "version": self.learner.version,
                             "staleness": staleness, "reward_mean": float(reward.mean()),
                             "read_s": t0 - t_read, "update_s": t1 - t0,
                             **{k: float(v) for k, v in stats.items() if k in
                                ("loss", "clip_frac", "approx_kl", "iw_mean", "iw_max", "entropy", "rows",
                                 "rolled_back", "guard_skipped", "guard_rollbacks")}})
        self._since_ckpt += 1
        if self._since_ckpt >= self.cfg.async_rl.checkpoint_every:
            self.checkpoint()
        t2 = time.perf_counter()
        self.publish()
        self.history[-1].update(checkpoint_s=t2 - t1, publish_s=time.perf_counter() - t2)
        return "consumed"

    def run(self) -> dict[str, Any]:
        a, rs = self.cfg.async_rl, self.rs
        start, updates_here = time.perf_counter(), 0
        last = start
        stopped = False
        while len(handled := self.handled()) < self.expected:
            if rs.stop_requested():
                stopped = True
                break
            if self.max_updates is not None and updates_here >= self.max_updates:
                stopped = True
                break
            pending = [b for b in rs.retry(rs.trajectories.list_batches, "listing trajectories") if b not in handled]
            now = time.perf_counter()
            self.totals["wall_s"] += now - last
            last = now
            if not pending and self.sample_self():
                continue  # its time is counted as wall (not idle) at the top of the next pass
            if not pending:
                time.sleep(a.poll_interval)
                waited = time.perf_counter() - last
                self.totals["idle_s"] += waited
                self.totals["wall_s"] += waited
                if not handled:  # nothing ever arrived yet: the pipeline is still filling
                    self.totals["fill_s"] = self.totals.get("fill_s", 0.0) + waited
                last = time.perf_counter()
                continue
            outcome = self.step(pending[0])
            updates_here += outcome == "consumed"
            rs.write_json(self.status(), "learner", "status.json")
        now = time.perf_counter()
        self.totals["wall_s"] += now - last
        self.checkpoint()
        status = self.status(done=not stopped)
        rs.write_json(status, "learner", "status.json")
        rs.write_json({"history": self.history, "ledger": self.ledger}, "learner", "history.json")
        if self.owns_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
        return status
