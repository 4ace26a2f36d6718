"""The asynchronous protocol as two named channels that the samplers and the learner both use
(the roles of verl's fully-async ``MessageQueue`` and ``ParameterSynchronizer``, on object storage):

* :class:`BatchChannel`, trajectories from samplers to the learner: a slot of the run's sample
  budget (one exclusive create, :class:`SlotClaims`), admission (a slot starts only while the
  learner's version admits it, :func:`admits`), the commit (data, then the marker), and the
  learner's verdict on a committed batch (fresh, or staler than ``async_rl.max_staleness``).
* :class:`PolicyChannel`, adapters from the learner to the samplers: publish a version (files,
  then ``adapters/LATEST``), read which version is the latest, load one into a resident peft
  model (LoRA tensors only: the base stays where it is).

Neither holds state beyond the run's store (storage/run.py), so a restarted worker opens them
again and carries on. Why admission instead of dropping stale batches at the learner, and why a
version pointer: asyncrl/sampler.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from torch import Tensor, nn

from miles_core.config import RecipeConfig
from miles_core.learner.ledger import Verdict
from miles_core.models.lora import ADAPTER_WEIGHTS, native_adapter_state
from miles_core.storage import AdapterExistsError, BatchExistsError
from miles_core.storage import uri as U
from miles_core.storage.run import RunStore
from miles_core.types import Batch


def admits(slot: int, version: int, per_update: int, staleness: int, passed: int = 0) -> bool:
    """Whether batch slot ``slot`` may start while the learner is at ``version``: AReaL's capacity
    rule (areal/infra/staleness_manager.py: capacity = (S + v + 1) B - (accepted + running)), with
    slots numbered in the order they are taken. After ``passed`` batches taken without an update
    (dropped or quarantined), update u consumes slots [uB + passed, (u+1)B + passed), so a slot
    admitted while slot < (S + v + 1) B + passed is at most S versions stale when it is used (unless
    it is much slower than the batches around it; the learner's verdict stays as the guard).
    Without ``passed`` each dropped batch would hold one slot of the window for the rest of the
    run: the window shrinks by one per drop, and with B drops a version's worth of samplers waits
    for good (AReaL's capacity counts only accepted rollouts for the same reason).

    With in-flight refresh the rule is the same: it bounds the rollout's first step, the oldest;
    its later steps sample with adapters published while it runs and are younger. Admitting a
    rollout earlier because its last steps will be fresh would make its first steps older than S,
    and those are not learned from: as many steps lost as completions gained."""
    return slot < (staleness + version + 1) * per_update + passed


def poll_intervals(first: float, backoff: float, cap: float) -> Iterator[float]:
    """Waits between polls: ``first``, then times ``backoff`` each, never above ``max(cap, first)``."""
    interval = first
    while True:
        yield interval
        interval = min(interval * backoff, max(cap, first))


class SlotClaims:
    """The run's shared sample budget: ``total`` slots, each taken by one exclusive create of
    ``samplers/claims/slot-NNNNNN`` naming the batch id it is for.

    Two workers never take the same slot, so the run's total stays exactly the budget the learner
    expects however the work splits between them (a fast sampler takes a slow one's share).
    """

    def __init__(self, rs: RunStore, total: int) -> None:
        self.rs, self.total = rs, total
        self.folder = rs.path("samplers", "claims")

    def own(self, worker: str) -> dict[str, int]:
        """Batch id -> slot of what ``worker`` claimed before a restart (a claim without a commit
        is redone first)."""
        rs, out = self.rs, {}
        for name in rs.retry(lambda: U.list_names(rs.fs, self.folder), "listing claims"):
            if name.startswith("slot-"):
                bid = rs.retry(lambda: U.read_json(rs.fs, U.join(self.folder, name)), f"reading claim {name}")["batch"]
                if bid.endswith(f"-{worker}"):
                    out[bid] = int(name[len("slot-"):])
        return out

    def _try(self, k: int, bid: str) -> bool:
        rs, name = self.rs, f"slot-{k:06d}"
        try:
            rs.retry(lambda: U.create_exclusive(rs.fs, U.join(self.folder, name), U.dumps({"batch": bid})),
                     f"claiming {name}")
            return True
        except U.AlreadyExistsError:  # another worker won it, or our own write whose reply was lost
            got = rs.retry(lambda: U.read_json(rs.fs, U.join(self.folder, name)), f"reading claim {name}")
            return got.get("batch") == bid

    def claim(self, bid: str, prefer: int | None = None) -> int | None:
        """Take a slot for ``bid`` -> its number, or None when every slot is taken. ``prefer``:
        the worker's next slot in its own stripe, tried first with one exclusive create, so a claim
        costs one request however many workers there are; only when another worker took it (a
        fast one taking a slow one's share) are the claims listed for the lowest free slot."""
        if prefer is not None and prefer < self.total and self._try(prefer, bid):
            return prefer
        rs = self.rs
        taken = set(rs.retry(lambda: U.list_names(rs.fs, self.folder), "listing claims"))
        for k in range(self.total):
            if f"slot-{k:06d}" not in taken and self._try(k, bid):
                return k
        return None


class BatchChannel:
    """Trajectories from the samplers to the learner (module docstring), for the run in ``rs``
    with the recipe ``cfg``: B sampler batches per update (``async_rl.global_batch``), the
    staleness bound S (``async_rl.max_staleness``), a budget of ``num_samplers x batches_per_sampler``.
    ``inbox``: the run announces each commit in the trajectory store's inbox, which the learner
    lists instead of every commit marker (a run created with it says so in ``run.json``:
    :func:`uses_inbox`; older runs are listed as before)."""

    def __init__(self, rs: RunStore, cfg: RecipeConfig, inbox: bool = False) -> None:
        a = cfg.async_rl
        self.rs, self.per_update, self.bound = rs, cfg.batches_per_update(), cfg.async_rl.max_staleness
        self.claims = SlotClaims(rs, a.num_samplers * a.batches_per_sampler)
        self.inbox = inbox

    def admits(self, slot: int, version: int, passed: int = 0) -> bool:
        """:func:`admits` with this run's B and S."""
        return admits(slot, version, self.per_update, self.bound, passed)

    def commit(self, batch: Batch, bid: str) -> bool:
        """Commit ``batch`` as ``bid``, then announce it -> False when an earlier attempt's commit
        landed (the stored one counts: batch ids are deterministic, so it is the same batch; it is
        announced again, in case that attempt died between its commit and its announcement)."""
        rs = self.rs
        try:
            rs.retry(lambda: rs.trajectories.write_batch(batch, batch_id=bid), f"committing batch {bid}")
            fresh = True
        except BatchExistsError:
            fresh = False
        if self.inbox:
            rs.retry(lambda: rs.trajectories.announce(bid), f"announcing batch {bid}")
        return fresh

    def waiting(self) -> list[str]:
        """The committed batch ids the learner may not have taken yet, sorted: the inbox (what is in
        flight), or, in a run without one, every commit marker."""
        rs = self.rs
        if self.inbox:
            return rs.retry(rs.trajectories.list_inbox, "listing the inbox")
        return rs.retry(rs.trajectories.list_batches, "listing trajectories")

    def verdict(self, batch: Batch, version: int) -> Verdict:
        """The learner's verdict at ``version`` on a committed batch: fresh (with the version of its
        oldest step), or dropped (with that staleness) when even its newest step is more than S
        versions old. Staleness is a step's: a batch sampled with in-flight refresh keeps the
        steps newer adapters took, and the update gives no weight to those older than S
        (``Learner.update``); without refresh every step of a batch is its one version."""
        oldest = int(batch.policy_version.min())
        newest = int(batch.versions().max())
        if version - newest > self.bound:
            return Verdict.dropped(version - oldest)
        return Verdict.fresh(oldest)


def uses_inbox(spec: dict[str, Any]) -> bool:
    """Whether the run whose ``run.json`` is ``spec`` announces its commits (storage/run.py::prepare_run)."""
    return bool(spec.get("protocol", {}).get("inbox", False))


class PolicyChannel:
    """Adapters from the learner to the samplers (module docstring), in the run's store ``rs``."""

    def __init__(self, rs: RunStore) -> None:
        self.rs = rs

    def publish(self, local_dir: str | Path, version: int, passed: int = 0) -> None:
        """Upload the adapter folder ``local_dir`` as ``version`` and move ``LATEST`` to it, naming
        the ``passed`` batches taken without an update (admission reads both, :func:`admits`); a
        version committed already (an attempt that failed after its commit marker, a resumed run)
        is left as it is."""
        rs = self.rs
        try:
            rs.retry(lambda: rs.adapters.publish(local_dir, version=version, metadata={"published_unix": time.time()},
                                                 pointer={"passed": passed}), f"publishing adapter v{version}")
        except AdapterExistsError:
            pass

    def pass_on(self, passed: int) -> None:
        """Say in ``LATEST`` that ``passed`` batches were taken without an update (a drop between
        two versions frees its slot of the admission window at once)."""
        rs = self.rs
        rs.retry(lambda: rs.adapters.repoint({"passed": passed}), "updating adapters/LATEST")

    def admission(self) -> tuple[int | None, int]:
        """(the version ``LATEST`` names, the batches passed without an update): one small read."""
        rs = self.rs
        doc = rs.retry(rs.adapters.pointer_doc, "polling adapters/LATEST")
        return (None, 0) if doc is None else (int(doc["version"]), int(doc.get("passed", 0)))

    def latest(self) -> int | None:
        """The version ``adapters/LATEST`` names: one small read, what samplers poll."""
        rs = self.rs
        return rs.retry(rs.adapters.pointer, "polling adapters/LATEST")

    def load_into(self, model: nn.Module, version: int, dest: Path) -> dict[str, Any]:
        """Fetch ``version`` into the folder ``dest`` and copy its LoRA tensors into the peft
        ``model`` in place -> its manifest (files with their bytes, the publisher's metadata).
        An adapter whose tensors do not fit the model is an error naming them."""
        state, manifest = self.fetch(version, dest)
        self.apply(model, version, state)
        return manifest

    def fetch(self, version: int, dest: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Fetch ``version`` into the folder ``dest`` -> its LoRA tensors (in memory, as published)
        and its manifest; the model is not touched (an in-flight refresh fetches while it samples)."""
        rs = self.rs
        manifest = rs.retry(lambda: rs.adapters.manifest(version), f"reading adapter v{version} manifest")
        rs.retry(lambda: rs.adapters.fetch(version, dest, manifest), f"fetching adapter v{version}")
        return load_file(str(dest / ADAPTER_WEIGHTS)), manifest

    @staticmethod
    def apply(model: nn.Module, version: int, state: dict[str, Tensor]) -> None:
        """Copy the fetched LoRA tensors ``state`` of ``version`` into the peft ``model`` in place; an
        adapter whose tensors do not fit the model is an error naming them."""
        result = set_peft_model_state_dict(model, native_adapter_state(model.get_base_model(), state))
        if result.unexpected_keys:
            raise ValueError(f"adapter v{version} does not fit this model: unexpected keys {result.unexpected_keys[:3]}")
