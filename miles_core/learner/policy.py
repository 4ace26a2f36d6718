"""The RL policy state every learner drives: frozen base + LoRA adapter, optimizer, LR schedule,
RNGs, policy version and the collapse guard. One object for the synchronous flow, the asynchronous
learner, the torchrun learner and the benchmarks, so what a benchmark measures is what a user
runs; ``state()``/``load_state()`` capture everything needed to resume bit-exactly. The run
around it (ledger, checkpoints, publishing) is miles_core/learner/runtime.py.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from miles_core.algo.guard import CollapseGuard, batch_health
from miles_core.algo.rl import sample_batch
from miles_core.algo.schedule import lr_factor
from miles_core.algo.draws import Draws
from miles_core.algo.update import update_policy
from miles_core.config import RecipeConfig
from miles_core.data.registry import TaskData
from miles_core.models.base import AnyTokenizer, base_identity, load_base, resolve_device
from miles_core.models.activations import checkpoint_layers
from miles_core.models.lora import adapter_tensors, add_lora_from, load_adapter, save_adapter
from miles_core.models.window import WindowDenoiser, inner
from miles_core.parallel import World, full_tensors, shard_like, shard_model
from miles_core.rewards.registry import reward_for_recipe
from miles_core.types import Batch


def build_policy(cfg: RecipeConfig, base_dir: str | Path, adapter_dir: str | Path | None = None,
                 trainable: bool = True) -> tuple[nn.Module, AnyTokenizer]:
    """The policy every role runs, built one way: the recipe's base (frozen) on ``model.device``
    with LoRA on it, either ``adapter_dir``'s or the recipe's ``lora`` section initialised from
    ``train.seed``. ``trainable``: the learner's; a sampler's (False) has no LoRA dropout, since it
    only samples and its adapter's tensors are replaced in place at every version. Torch's global
    generators are left as they were: a process that wants LoRA dropout's draws repeatable seeds
    them itself (the training tasks and the asynchronous learner's process do, from ``train.seed``)."""
    device = resolve_device(cfg.model.device)
    # building the base draws from torch's global generators (its layers' init, then overwritten by
    # the checkpoint) and so does LoRA's init (peft takes no generator): both run in a fork of them,
    # LoRA's seeded from train.seed, so building a policy leaves the process's generators as they were
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        base, tok = load_base(cfg, base_dir)
        for p in base.parameters():
            p.requires_grad_(False)
        base.to(device)  # before LoRA: a sampler's adapter swaps copy into tensors already there
        if adapter_dir is not None:
            model = load_adapter(base, adapter_dir, trainable=trainable)
        else:
            torch.manual_seed(cfg.train.seed)
            model = add_lora_from(base, cfg.lora, dropout=None if trainable else 0.0)
    return model.to(device), tok


class Learner:
    """Base (frozen) + LoRA policy, optimizer, warm-up schedule, update RNG and policy version.

    Everything random derives from ``cfg.train.seed`` (one seed per run, as every worker of the run
    reads it from the recipe). ``state()``/``load_state()`` capture everything needed to resume
    bit-exactly."""

    def __init__(self, cfg: RecipeConfig, base_dir: str | Path, adapter_dir: str | Path | None = None,
                 total_updates: int | None = None, world: World | None = None):
        seed = cfg.train.seed
        self.cfg, self.base_dir, self._base_identity = cfg, base_dir, None
        self.model, self.tok = build_policy(cfg, base_dir, adapter_dir)  # on its device before the optimizer
        o, u = cfg.optim, cfg.update
        if u.grad_checkpointing:  # memory for compute: each layer's activations recomputed in backward
            checkpoint_layers(self.model)
        self.sharded = world is not None and world.size > 1 and cfg.async_rl.fsdp
        if self.sharded:  # FSDP2: each rank holds 1/D of base and adapter (parallel.py)
            root = inner(self.model)
            shard_model(root, world, ("window",) if isinstance(root, WindowDenoiser) else ())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, weight_decay=0.0)
        # optim.lr_schedule decays over the run: total_updates (default train.iterations) policy updates,
        # each num_minibatches * epochs optimizer steps
        updates = cfg.train.iterations if total_updates is None else total_updates
        steps = updates * u.num_minibatches * u.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(o.warmup, o.lr_schedule, steps))
        self.gen = torch.Generator().manual_seed(seed)  # the update's row draws (sampling is seeded per batch)
        self.version = 0
        self.reward_fn = reward_for_recipe(cfg)
        self.guard = CollapseGuard(cfg.guard, self._policy_state()) if cfg.guard.enabled else None
        self.guard_event = ""  # why the last update was skipped or rolled back ("" when it ran)

    def _policy_state(self) -> dict:
        """What a rollback restores: adapter, optimizer and schedule (not the RNGs), as copies that
        later steps cannot change; ``state()`` adds the RNGs, version and guard to it."""
        return {"adapter": {k: v.detach().clone() for k, v in self.model.state_dict().items() if "lora_" in k},
                "opt": copy.deepcopy(self.opt.state_dict()), "sched": self.sched.state_dict()}

    def sample(self, data: TaskData, seq: int, worker: str = "learner", index: int = 0) -> Batch:
        """Batch ``seq`` of ``worker`` sampled with the current policy, scored, with advantages:
        :func:`~miles_core.algo.rl.sample_batch`, the one batch producer (seeded by the run seed,
        the worker and ``seq``, never by state the learner carries)."""
        return sample_batch(self.cfg, self.model, self.tok, data, self.reward_fn, worker, index, seq, self.version)

    def update(self, batch: Batch, world: World | None = None, keys: torch.Tensor | None = None,
               leads: torch.Tensor | None = None) -> dict[str, float]:
        """One ADPO update on ``batch``, unless the collapse guard sees in it that the policy collapsed:
        then the batch is skipped and (first sign of it; for a reward drop, the ``guard.confirm``-th
        unhealthy batch in a row) the last healthy policy is restored and published as a new
        version; ``stats["rolled_back"]``/``["guard_skipped"]`` say so and ``self.guard_event`` says why.
        Raises CollapseError when rolling back no longer helps. ``keys`` [B]: each trajectory's
        name for its random draws (algo/draws.py; default its position). ``world``: data-parallel
        ranks (torchrun), ``batch`` being this rank's share of the global batch and ``keys`` its
        trajectories' keys (learner/shares.py) and ``leads`` [B] their groups' first members' keys
        (a group may straddle ranks); the guard sees the whole batch's health on every rank.
        Steps sampled more than ``async_rl.max_staleness`` versions ago are not learned from (a
        batch sampled with in-flight refresh can hold such steps beside fresh ones)."""
        self.guard_event = ""
        if self.guard is not None:
            h = batch_health(batch, world)
            reason = self.guard.collapse_reason(h)
            if reason is not None:
                self.guard_event = reason
                # sampled by the collapsed line (already rolled back), or a reward drop not yet confirmed
                if not self.guard.should_roll_back(h) or not self.guard.confirmed(h):
                    return {"rows": 0.0, "guard_skipped": 1.0, "policy_version": float(self.version),
                            "guard_rollbacks": float(self.guard.rollbacks)}
                self.version += 1
                self._restore(self.guard.rolled_back(self.version, reason))
                logging.getLogger("miles").warning("collapse guard: %s; restored policy version %d as version %d",
                                                   reason, self.guard.good[0], self.version)
                return {"rows": 0.0, "rolled_back": 1.0, "policy_version": float(self.version),
                        "guard_rollbacks": float(self.guard.rollbacks)}
            self.guard.accept(h)
        draws = Draws.seeded(self.gen, torch.arange(len(batch)) if keys is None else keys, leads)
        stats = update_policy(self.model, self.opt, batch, self.cfg.update, self.tok, self.cfg.sampler.temperature,
                              draws, scheduler=self.sched, world=world, version=self.version, own=self.cfg.own(),
                              oldest=self.version - self.cfg.async_rl.max_staleness)
        self.version += 1
        if self.guard is not None:
            self.guard.offer(self.version, self._policy_state)
            stats["guard_rollbacks"] = float(self.guard.rollbacks)
        stats["policy_version"] = float(self.version)
        return stats

    def _restore(self, st: dict) -> None:
        """Inverse of ``_policy_state`` (also the first half of ``load_state``). The optimizer state
        is copied in, so later in-place steps never write into a snapshot the guard still holds."""
        missing = self.model.load_state_dict(st["adapter"], strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"checkpoint has unexpected adapter keys: {missing.unexpected_keys[:3]}")
        self.opt.load_state_dict(copy.deepcopy(st["opt"]))
        self.sched.load_state_dict(st["sched"])

    def full_adapter(self) -> dict[str, torch.Tensor] | None:
        """A sharded learner's adapter tensors gathered whole (a collective: every rank calls it
        before rank 0 publishes); None when every rank holds them whole already."""
        return full_tensors(adapter_tensors(self.model)) if self.sharded else None

    def save_adapter(self, directory: str | Path, dtype: torch.dtype | None = None,
                     tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """The peft folder of the current adapter (``tensors``: :meth:`full_adapter`'s, when sharded)."""
        if self._base_identity is None:  # hashed once per learner: the async learner publishes every update
            self._base_identity = base_identity(self.base_dir)
        return save_adapter(self.model, directory, dtype, base=self._base_identity, tensors=tensors)

    def state(self) -> dict:
        """Everything a resume needs, as full tensors (a sharded learner gathers: every rank calls it)."""
        st = {**self._policy_state(), "gen": self.gen.get_state(),
              "version": self.version, "torch_rng": torch.get_rng_state(),
              "guard": self.guard.state() if self.guard else None}
        return full_tensors(st) if self.sharded else st

    def load_state(self, st: dict) -> None:
        if self.sharded:  # the checkpoint holds full tensors: each rank keeps its shard of them
            live = self.model.state_dict()
            opt = copy.deepcopy(st["opt"])
            for i, s in opt["state"].items():
                opt["state"][i] = {k: shard_like(v, self.params[i]) if torch.is_tensor(v) and v.dim() else v
                                   for k, v in s.items()}
            st = {**st, "adapter": {k: shard_like(v, live[k]) for k, v in st["adapter"].items()}, "opt": opt}
        self._restore(st)
        self.gen.set_state(st["gen"])
        self.version = int(st["version"])
        torch.set_rng_state(st["torch_rng"])
        if self.guard is not None and st.get("guard") is not None:  # older checkpoints: a fresh guard
            self.guard.load_state(st["guard"])

