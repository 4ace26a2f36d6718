"""The asynchronous learner: the run's :class:`~miles_core.learner.runtime.LearnerRun` in a loop.

Per pass: list the committed batches not in the ledger; once B of them wait (B sampler batches
make one global batch, ``async_rl.global_batch``), ``consume`` the oldest B in one update (read,
staleness check, update, checkpoint, publish: learner/runtime.py, the same code the synchronous
flow runs) and write status.json for operators. Publishing moves ``adapters/LATEST``, which is
all the samplers read: a new version admits the next B slots (learner/channels.py::admits). While fewer
than B wait: with ``async_rl.learner_samples`` it claims a slot of the shared sample budget and
samples that batch itself with the current policy (committed like any sampler's, so the ledger
and restarts treat it the same), else it sleeps with back-off and the wait counts as idle. See
ARCHITECTURE.md.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch

from miles_core.algo.rl import SELF_WORKER as SELF  # the worker name of batches the learner samples itself
from miles_core.algo.rl import batch_id, batch_seq
from miles_core.allocator import apply_heap_setting
from miles_core.learner.channels import poll_intervals
from miles_core.config import load_recipe
from miles_core.learner.runtime import LearnerRun
from miles_core.parallel import World
from miles_core.storage.run import RunStore

log = logging.getLogger(__name__)
# How long a learner waits with nothing new before it lists every commit marker for batches that
# were committed but never announced (AsyncLearner._unannounced): that listing's cost grows with the
# run's age, so it is paid only when the run is stuck, never while batches arrive.
UNANNOUNCED_SCAN_S = 60.0


class AsyncLearner(LearnerRun):
    """The learner of an asynchronous run: one process, or D data-parallel ranks under torchrun
    (``world``; rank 0 lists, decides and writes, every rank reads its share of each global batch
    and takes part in the update). ``run()`` returns the final status."""

    def __init__(self, run_uri: str, cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                 max_updates: int | None = None, world: World | None = None) -> None:
        cfg = load_recipe(RunStore(run_uri, storage_options).read_spec()["cfg"])
        torch.set_num_threads(cfg.async_rl.learner_threads)
        torch.manual_seed(cfg.train.seed)  # the learner process's generator (LoRA dropout's draws)
        apply_heap_setting(cfg.async_rl.retain_heap_mb)  # else its self-sampled batches fault in fresh pages every step
        # one update per B sampler batches: the LR schedule spans the run's budget of updates
        super().__init__(run_uri, cache_dir, storage_options, cfg,
                         total_updates=-(-cfg.async_rl.num_samplers * cfg.async_rl.batches_per_sampler
                                         // cfg.batches_per_update()), world=world)  # the last may be short
        self.max_updates = max_updates  # stop after this many updates in this process (tests, chaos)
        self._stuck: tuple[int, float] | None = None  # (batches waiting, since when): _unannounced
        self._init_self_sampling()
        self.requests_at_start = self.rs.requests.total()  # the spec, the base, checkpoint and adapter checks

    # ------------------------------------------------------------------ sampling instead of waiting
    def _init_self_sampling(self) -> None:
        a = self.cfg.async_rl
        self.claims = self.batches.claims if a.learner_samples and self.world.is_main else None
        self._redo: list[tuple[str, int]] = []  # (batch id, slot) claimed before a restart, not committed
        self._next_seq = 0
        if self.claims is None:
            return
        mine = self.claims.own(SELF)
        committed = set(self.rs.retry(self.rs.trajectories.list_batches, "listing trajectories"))
        quarantined = set(self.rs.retry(self.rs.trajectories.list_quarantined, "listing quarantine"))
        # claimed, then killed before the commit: redo those first (never one already handled or quarantined)
        self._redo = sorted((b, k) for b, k in mine.items() if b not in committed and b not in quarantined
                            and b not in self.ledger)
        self._next_seq = 1 + max((batch_seq(b) for b in mine), default=-1)

    def sample_self(self) -> bool:
        """Sample one batch of the shared budget with the current policy, if the admission rule
        lets its slot start now; False when it does not, or once the budget is claimed."""
        if self.claims is None:
            return False
        a = self.cfg.async_rl
        if self._redo:
            bid, slot = self._redo[0]
        else:
            # no stripe of its own: the lowest free slot (one listing, made only while it would
            # idle), so the samplers' stripes stay dense and admission, which counts slots, is
            # not held back by slots reserved for a learner that samples only when nothing waits
            bid = batch_id(self._next_seq, SELF)
            got = self.claims.claim(bid)
            if got is None:
                self.claims = None  # every slot is taken: from now on only wait for the samplers' batches
                return False
            self._next_seq += 1
            self._redo.append((bid, got))
            slot = got
        if not self.batches.admits(slot, self.learner.version, self.passed):
            return False  # claimed, sampled once the version admits it
        self._redo.pop(0)
        t0 = time.perf_counter()
        _, _, reused = self.collect(batch_seq(bid), SELF, a.num_samplers)
        if reused:
            log.info("batch %s was already committed; the stored one counts", bid)
        self.totals["sample_s"] = self.totals.get("sample_s", 0.0) + time.perf_counter() - t0  # rollout + commit
        self.totals["self_batches"] = self.totals.get("self_batches", 0) + 1
        return True

    # ------------------------------------------------------------------ bookkeeping
    @property
    def expected(self) -> int:
        """The run's sample budget: the slots of its batch channel."""
        return self.batches.claims.total

    def status(self, done: bool = False) -> dict[str, Any]:
        """Progress for operators and benchmarks (samplers read only ``adapters/LATEST``): running
        totals, so it costs the same whatever the run's age."""
        ledger = self.ledger
        wall = max(self.totals["wall_s"], 1e-9)
        return {"version": self.learner.version, "updates": len(self.history),
                "batches_per_update": self.cfg.batches_per_update(), "learner_ranks": self.world.size,
                "consumed": len(ledger.consumed), "dropped": len(ledger.dropped),
                "self_consumed": ledger.self_consumed,  # of those consumed, batches it sampled itself
                "quarantined": len(ledger.quarantined), "expected": self.expected, "done": done,
                "staleness_hist": {str(k): v for k, v in sorted(ledger.staleness.items())},
                "max_staleness_seen": ledger.max_staleness(), "staleness_bound": self.cfg.async_rl.max_staleness,
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
                "completions": ledger.completions,
                **self.rs.requests.report(), "requests_at_start": self.requests_at_start}

    def _decide(self, waits: Any) -> tuple[str, Any]:
        """Rank 0's next step: ("stop" | "done", None), ("update", batch ids), ("sampled", None)
        after sampling a batch itself, or ("waited", seconds) after one back-off sleep."""
        rs, ledger = self.rs, self.ledger
        if len(ledger) >= self.expected:
            return "done", None
        with rs.requests.phase("stop_check"):
            stop = rs.stop_requested()
        if stop or (self.max_updates is not None and self._updates_here >= self.max_updates):
            return "stop", None
        with rs.requests.phase("list"):
            listed = self.batches.waiting()
        pending = [b for b in listed if b not in ledger]
        need = min(self.cfg.batches_per_update(), self.expected - len(ledger))  # the last may be short (drops)
        if len(pending) < need and self.batches.inbox:
            pending = sorted(pending + self._unannounced(pending))  # the scan returns none of pending
        if len(pending) >= need:
            self._stuck = None
            return "update", pending[:need]
        if self.sample_self():
            return "sampled", None
        t0 = time.perf_counter()
        time.sleep(next(waits))
        return "waited", time.perf_counter() - t0

    def _unannounced(self, pending: list[str]) -> list[str]:
        """Committed batches that never reached the inbox (a writer that died between its commit
        and its announcement, and was not restarted to announce it again), announced now. It takes
        a full listing of the commit markers, whose cost grows with the run's age, so only once the
        learner has waited :data:`UNANNOUNCED_SCAN_S` seconds with the ``pending`` batches (those
        the inbox holds) and nothing new (then again every as many seconds): never while batches
        keep arriving. Only what the inbox lacks is announced."""
        now = time.monotonic()
        if self._stuck is None or self._stuck[0] != len(pending):
            self._stuck = (len(pending), now)
            return []
        if now - self._stuck[1] < UNANNOUNCED_SCAN_S:
            return []
        self._stuck = (len(pending), now)
        rs, known = self.rs, set(pending)
        with rs.requests.phase("scan"):
            missing = [b for b in rs.retry(rs.trajectories.list_batches, "listing trajectories")
                       if b not in self.ledger and b not in known]
            for b in missing:
                rs.retry(lambda: rs.trajectories.announce(b), f"announcing batch {b}")
        return missing

    def run(self) -> dict[str, Any]:
        a, rs, world = self.cfg.async_rl, self.rs, self.world
        self._updates_here = 0
        waits = poll_intervals(a.poll_interval, a.poll_backoff, a.poll_max_interval)
        last = time.perf_counter()
        while True:
            # every rank takes the same step; the others wait at most one poll interval for it
            kind, arg = world.broadcast_object(self._decide(waits) if world.is_main else None)
            now = time.perf_counter()
            if kind in ("done", "stop"):
                break
            if kind == "waited":
                self.totals["idle_s"] += arg
                if not len(self.ledger):  # nothing ever arrived yet: the pipeline is still filling
                    self.totals["fill_s"] = self.totals.get("fill_s", 0.0) + arg
            elif kind == "update":
                waits = poll_intervals(a.poll_interval, a.poll_backoff, a.poll_max_interval)  # poll fast again
                outcome, _ = self.consume(arg)
                self._updates_here += outcome == "consumed"
                if world.is_main:
                    with rs.requests.phase("status"):
                        rs.write_json(self.status(), "learner", "status.json")
            self.totals["wall_s"] += now - last
            last = now
        self.totals["wall_s"] += time.perf_counter() - last
        self.checkpoint()
        status = self.status(done=kind == "done")
        if world.is_main:
            rs.write_json(status, "learner", "status.json")
            rs.write_json({"history": self.history, "ledger": self.ledger.state()}, "learner", "history.json")
        else:  # what this rank's share of the reading cost the store
            rs.write_json({"rank": world.rank, **rs.requests.report(), "requests_at_start": self.requests_at_start},
                          "learner", f"rank{world.rank}.json")
        if self.owns_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
        return status
