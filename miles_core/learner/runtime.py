"""The run around one :class:`~miles_core.learner.policy.Learner`: the one learner runtime.

The synchronous flow (a collect and an update task per iteration: tasks/training.py) and the
asynchronous learner (asyncrl/learner.py) drive the same object, so resume and exactly-once are
one implementation:

    collect(seq):       sample batch seq with the current policy (algo/rl.py::sample_batch), score
                        it, commit it to trajectories/ (a retry samples the same prompts and noise)
    consume(batch id):
        read the batch (a corrupt one is quarantined and recorded, never fatal)
        staleness s = current version - the batch's policy version; s > S: drop it and record it
        ADPO update with the truncated importance weight against the stored behaviour log-probs
        version += 1; checkpoint every N updates; publish the adapter

Exactly-once: the *ledger* (which batch ids were consumed, dropped or quarantined) lives inside
the learner checkpoint, next to the adapter and optimizer it produced, and both are written in
one atomic object. A learner killed after an update but before its checkpoint resumes from the
previous checkpoint, whose ledger does not list that batch, so the batch is used again by the
surviving lineage and exactly once there. Adapter versions the dead learner published after its
last checkpoint are orphaned: the resumed learner numbers its next version above them, so a
number is never reused for different weights. The store layout is miles_core/storage/run.py.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.rl import batch_id
from miles_core.algo.update import global_counts
from miles_core.config import RecipeConfig, load_recipe
from miles_core.data.registry import TaskData, build_task
from miles_core.learner.channels import BatchChannel, PolicyChannel, uses_inbox
from miles_core.learner.policy import Learner
from miles_core.learner import ledger as ledger_parts
from miles_core.learner.ledger import Ledger, Verdict
from miles_core.learner.shares import RankSpeeds, agree, deal_unit, first_reader, held_rows, my_share
from miles_core.parallel import World
from miles_core.storage import CorruptBatchError
from miles_core.types import Batch, TrajectoryBatch
from miles_core.storage.run import RunStore, changed_settings

log = logging.getLogger(__name__)
# Settings that may change when a run is resumed (its length, evaluation, threads); anything else
# would silently change the experiment, so it is refused.
RESUMABLE = ("train.iterations", "train.eval_every", "eval.", "torch_threads", "async_rl.fsdp", "async_rl.deal")
HISTORY_KEYS = ("loss", "clip_frac", "approx_kl", "iw_mean", "iw_max", "entropy", "rows", "rolled_back",
                "guard_skipped", "guard_rollbacks", "stale_rows")


class LearnerRun:
    """A learner bound to the run at ``run_uri``: its ledger, checkpoints and published adapters.

    ``cfg``: the recipe to run with (default: the run's own); it may differ from ``run.json`` only
    in :data:`RESUMABLE` settings. ``total_updates``: how many policy updates the LR schedule spans.
    ``checkpoint_every``: default ``async_rl.checkpoint_every`` (the synchronous flow passes 1).
    """

    def __init__(self, run_uri: str, cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                 cfg: RecipeConfig | None = None, total_updates: int | None = None,
                 checkpoint_every: int | None = None, world: World | None = None) -> None:
        self.world = world or World()  # D data-parallel ranks: one ledger, rank 0 writes and publishes
        self.rs = RunStore(run_uri, storage_options)
        spec = self.rs.read_spec()
        if cfg is not None:
            changed = changed_settings(spec["cfg"], cfg.to_dict(), RESUMABLE)
            if changed:
                raise ValueError(f"{run_uri}: cfg differs from run.json in {changed[:5]}, which a resume may not change")
        self.cfg = cfg or load_recipe(spec["cfg"])
        self.rs.retry_budget_s = self.cfg.async_rl.retry_budget_s
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix="miles-learner-"))
        self.owns_cache = cache_dir is None  # a temp folder of its own: removed when the run ends
        self.checkpoint_every = checkpoint_every or self.cfg.async_rl.checkpoint_every
        self.learner = Learner(self.cfg, self.rs.fetch_base(self.cache),
                               total_updates=total_updates, world=self.world)
        self.batches = BatchChannel(self.rs, self.cfg, inbox=uses_inbox(spec))  # learner/channels.py
        self.policy = PolicyChannel(self.rs)
        # async_rl.deal = "speed": each global batch dealt by the ranks' measured speeds (learner/shares.py)
        self.speeds = RankSpeeds() if self.world.size > 1 and self.cfg.async_rl.deal == "speed" else None
        self.ledger = Ledger()
        self._ledger_parts: list[str] = []  # the ledger parts the last checkpoint names (learner/ledger.py)
        self.history: list[dict[str, Any]] = []
        self.totals: dict[str, Any] = {"idle_s": 0.0, "wall_s": 0.0, "fill_s": 0.0, "resumes": 0, "version_skips": 0}
        ckpt = self.rs.load_checkpoint()
        if ckpt is not None:
            self.learner.load_state(ckpt["learner"])
            self.ledger, self._ledger_parts = ledger_parts.load(self.rs, ckpt["ledger"])
            self.history, self.totals = ckpt["history"], ckpt["totals"]
            self.totals["resumes"] += 1
            if "fallback" in ckpt:  # the newest was damaged: storage/run.py::load_checkpoint said which it used
                self.totals["checkpoint_fallbacks"] = [*self.totals.get("checkpoint_fallbacks", []), ckpt["fallback"]]
        latest = self.rs.retry(self.rs.adapters.latest_version, "polling adapters")
        if latest is not None and latest > self.learner.version:
            # versions published after the last checkpoint by a learner that died: never reuse them
            log.warning("resuming at checkpoint version %d below published %d; next version is %d",
                        self.learner.version, latest, latest + 1)
            self.learner.version = latest
            self.totals["version_skips"] += 1
        if not self.learner.sharded:  # as DDP does at start (equal already: same seed or checkpoint)
            self.world.broadcast_(self.learner.params)
        self._since_ckpt = 0
        self._data: TaskData | None = None
        self._collected: tuple[str, Batch] | None = None  # the batch collect() just committed
        unpublished = self.world.is_main and not self.rs.retry(
            lambda: self.rs.adapters.is_committed(self.learner.version), "checking adapter")
        if self.world.broadcast_object(unpublished):  # rank 0's answer: every rank joins a sharded publish
            self.publish()

    def checkpoint(self) -> None:
        self._since_ckpt = 0
        if not (self.world.is_main or self.learner.sharded):  # same state everywhere; rank 0 writes it
            return
        state = self.learner.state()  # sharded: gathered on every rank (a collective)
        if not self.world.is_main:
            return
        with self.rs.requests.phase("checkpoint"):
            parts = ledger_parts.save_part(self.rs, self.ledger, self._ledger_parts, self.learner.version)
            blob = {"learner": state, "ledger": {"parts": parts}, "history": self.history,
                    "totals": self.totals, "version": self.learner.version}
            self.rs.save_checkpoint(blob, self.learner.version)
        self._ledger_parts = parts
        self.ledger.mark_saved()
        if self.batches.inbox:  # every batch the ledger lists is in the checkpoint just saved
            rs = self.rs
            with rs.requests.phase("retire"):
                taken = [b for b in self.batches.waiting() if b in self.ledger]
                rs.retry(lambda: rs.trajectories.retire(taken), "retiring taken batches from the inbox")

    def publish(self) -> None:
        """Upload the current adapter as version ``learner.version`` (idempotent on resume)."""
        v = self.learner.version
        tensors = self.learner.full_adapter()  # sharded: every rank gathers (a collective); else None
        if not self.world.is_main:
            return
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp, self.rs.requests.phase("publish"):
            self.learner.save_adapter(tmp, getattr(torch, self.cfg.async_rl.sync_dtype), tensors)
            self.policy.publish(tmp, v, self.passed)

    @property
    def passed(self) -> int:
        """Batches taken without an update (dropped, quarantined): admission's window counts them."""
        return len(self.ledger.dropped) + len(self.ledger.quarantined)

    def adapter_uri(self, version: int | None = None) -> str:
        return f"{self.rs.uri}/adapters/v{self.learner.version if version is None else version:06d}"

    @property
    def data(self) -> TaskData:
        """The recipe's task (prompts to sample, the held-out split), built on first use."""
        if self._data is None:
            self._data = build_task(self.cfg)
        return self._data

    def collect(self, seq: int, worker: str = "learner", index: int = 0) -> tuple[str, Batch, bool]:
        """Sample batch ``seq`` of ``worker`` with the current policy, score it and commit it to
        ``trajectories/`` -> (batch id, batch, reused). The prompts and noise are seeded from the
        batch id, so a retry samples the same batch; when an earlier attempt's commit landed, the
        stored batch is the one that counts (``reused``). The batch stays in memory until the next
        collect, so a ``consume`` of it in this process does not read it back."""
        bid = batch_id(seq, worker)
        if bid in self.ledger:  # already consumed (a resumed run's backfill): read it, do not sample it again
            batch = self.rs.retry(lambda: self.rs.trajectories.read_batch(bid), f"reading batch {bid}")
            self._collected = (bid, batch)
            return bid, batch, True
        batch, reused = self.learner.sample(self.data, seq, worker, index), False
        if not self.batches.commit(batch, bid):
            batch = self.rs.retry(lambda: self.rs.trajectories.read_batch(bid), f"reading batch {bid}")
            reused = True
        self._collected = (bid, batch)
        return bid, batch, reused

    def _judge(self, bid: str, quarantine: bool = True) -> tuple[Verdict, Batch | None]:
        """Read batch ``bid`` (the one :meth:`collect` holds, else from the store) and judge it:
        corrupt (quarantined in the store here when ``quarantine``: one rank moves it),
        staler than ``async_rl.max_staleness``, or fresh."""
        if self._collected is not None and self._collected[0] == bid:
            batch, self._collected = self._collected[1], None  # committed by this process: no read back
        else:
            rs = self.rs
            try:
                with rs.requests.phase("read"):  # what reading one batch costs on the wire
                    batch = rs.retry(lambda: rs.trajectories.read_batch(bid), f"reading batch {bid}")
            except CorruptBatchError as e:
                reason = str(e)
                if quarantine:
                    rs.retry(lambda: rs.trajectories.quarantine(bid, reason), f"quarantining {bid}")
                return Verdict.quarantined(reason), None
        verdict = self.batches.verdict(batch, self.learner.version)
        return verdict, batch if verdict.kind == "fresh" else None

    def _read_share(self, bids: list[str]) -> tuple[list[tuple[str, int, int]], Batch, Tensor | None, Tensor | None]:
        """Judge the batches ``bids`` of one global batch and record the quarantined and dropped ones
        in the ledger -> (the fresh ones as (id, behaviour version, rows), this rank's rows of them,
        their trajectories' keys, with D ranks their groups' first members' keys). With D ranks
        each reads only its share (learner/shares.py: single trajectories, or whole groups for an
        estimator that reads them) and the ranks exchange their verdicts alone."""
        world, m = self.world, len(bids)
        group = self.cfg.train.group_size
        unit = deal_unit(group, self.cfg.update.estimator)
        n = self.cfg.train.prompts_per_iter * group  # rows of a sampler batch
        multi, speeds = world.size > 1, self.speeds.speeds if self.speeds else None
        share = my_share(m, n, unit, world, speeds) if multi else range(m)
        judged = {j: self._judge(bids[j], first_reader(j, n, m, unit, world, speeds)) for j in share}
        verdicts = agree(m, {j: v for j, (v, _) in judged.items()}, world)
        fresh: list[tuple[str, int, int]] = []
        parts: list[Batch] = []                 # this rank's rows of each fresh batch it read
        keys: list[Tensor] = []                 # their trajectories' keys (algo/draws.py)
        leads: list[Tensor] = []                # their groups' first members' keys
        for j, (bid, verdict) in enumerate(zip(bids, verdicts)):
            if verdict.kind == "quarantined":
                self.ledger.quarantine(bid, verdict.reason)
                continue
            if verdict.kind == "dropped":
                self.ledger.drop(bid, verdict.staleness)
                continue
            batch = judged[j][1] if j in judged else None
            fresh.append((bid, verdict.version, n if batch is None else len(batch)))
            if batch is None:
                continue
            if multi and (len(batch) != n or bool((batch.group_id.reshape(-1, group) != batch.group_id[::group, None]).any())):
                raise ValueError(f"batch {bid} is not {n} rows in groups of {group} consecutive rows; the ranks split "
                                 f"sampler batches of train.prompts_per_iter x train.group_size rows")
            part, part_keys, part_leads = held_rows(bid, j, batch, m, unit, group, world, speeds)
            parts.append(part)
            keys.append(part_keys)
            leads.append(part_leads)
        rows: Batch = (parts[0] if len(parts) == 1 else type(parts[0]).concat(parts) if parts
                       else TrajectoryBatch.empty(self.cfg.task.completion_len))
        return fresh, rows, torch.cat(keys) if keys else None, torch.cat(leads) if leads and multi else None

    def consume(self, bids: str | list[str]) -> tuple[str, dict[str, float]]:
        """One update on the committed batches ``bids`` (one global batch: ``async_rl.global_batch``
        completions) -> ('consumed' | 'dropped' | 'quarantined', update stats). Each batch is
        judged on its own: a corrupt one is quarantined, one staler than ``async_rl.max_staleness``
        dropped, both recorded; the rest are updated on together, and the ledger lists each with
        the update that consumed it."""
        bids = [bids] if isinstance(bids, str) else list(bids)
        t_read, world = time.perf_counter(), self.world if self.world.size > 1 else None
        dropped_before = len(self.ledger.dropped)
        fresh, batch, keys, leads = self._read_share(bids)
        if not fresh:  # no update, no publish: the samplers still learn of the slots freed
            if self.world.is_main:
                self.policy.pass_on(self.passed)
            return ("dropped" if len(self.ledger.dropped) > dropped_before else "quarantined"), {}
        version_before = self.learner.version
        staleness = version_before - min(v for _, v, _ in fresh)
        t0, waited = time.perf_counter(), self.world.waited_s
        stats = self.learner.update(batch, world=world, keys=keys, leads=leads)
        t1 = time.perf_counter()
        if self.speeds is not None:  # its own work: the update less its waits in collectives
            self.speeds.observe(self.world, len(batch), t1 - t0 - (self.world.waited_s - waited))
        stats.update(staleness=float(staleness), seconds=t1 - t0, batches=float(len(fresh)),
                     tokens_per_s=stats.get("tokens", 0.0) / max(t1 - t0, 1e-9))
        update = len(self.history) + 1
        for bid, v, rows in fresh:
            self.ledger.consume(bid, policy_version=v, learner_version=self.learner.version, rows=rows, update=update,
                                staleness=version_before - v)
        # a step's age: versions between the adapter that took it and the one this update started from
        ages = (version_before - batch.versions()).double()                       # [B, L]
        reward_sum, count, age_sum, positions = global_counts(
            world, float(torch.nan_to_num(batch.reward, nan=0.0).sum()), len(batch), float(ages.sum()), ages.numel())
        stats["step_age"] = age_sum / max(positions, 1.0)
        self.history.append({"update": update, "version": self.learner.version, "batches": len(fresh), "at": time.time(),
                             "staleness": staleness, "step_age": stats["step_age"], "reward_mean": reward_sum / max(count, 1.0),
                             "read_s": t0 - t_read, "update_s": t1 - t0, "guard_event": self.learner.guard_event,
                             **{k: float(v) for k, v in stats.items() if k in HISTORY_KEYS}})
        self._since_ckpt += 1
        if self._since_ckpt >= self.checkpoint_every:
            self.checkpoint()
        t2 = time.perf_counter()
        self.publish()
        self.history[-1].update(checkpoint_s=t2 - t1, publish_s=time.perf_counter() - t2)
        return "consumed", stats

    def last_update(self, bid: str) -> dict[str, Any]:
        """The history row of the update that consumed ``bid`` (a retried task reports it again)."""
        update = self.ledger.update_of(bid)
        row = dict(self.history[update - 1]) if update is not None and update <= len(self.history) else {}
        return {**row, "seconds": row.get("update_s", 0.0)}
