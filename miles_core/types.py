"""Core data types shared by samplers, learners and storage.

A trajectory is stored in O(L) per sequence, never O(K*L): the intermediate state x_k of the
denoising chain is rebuilt from ``step_map`` (the step at which each completion position was
committed). See SCHEMA.md (miles_core/storage) for the stored layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor


def _per_row(batch: Any, names: tuple[str, ...], b: int) -> None:
    """Per-row fields of a batch are [B]; a missing reward / advantage is NaN (not scored yet)."""
    for name in names:
        t = getattr(batch, name)
        if t.shape != (b,):
            raise ValueError(f"{type(batch).__name__}.{name}: expected shape [{b}], got {tuple(t.shape)}")
    if batch.reward is None:
        batch.reward = torch.full((b,), float("nan"))
    if batch.advantage is None:
        batch.advantage = torch.full((b,), float("nan"))


@dataclass
class TrajectoryBatch:
    """A batch of recorded discrete denoising trajectories, one row per sampled completion.

    Shapes (B = sequences, L = completion length):
      prompt_ids      list of B lists of token ids (ragged, unpadded)
      completion_ids  [B, L] long   final tokens of the completion
      step_map        [B, L] long   step index (0-based) at which each position was committed
      logp            [B, L] float  behaviour log-prob of the committed token at its step
      nfe             [B]    long   denoiser calls spent on this sequence
      group_id        [B]    long   rows with equal group_id share a prompt (GRPO group)
      policy_version  [B]    long   adapter version of the row's first step (with in-flight refresh,
                                    its oldest; else the version of every step)
      reward          [B]    float  NaN where not scored yet (or reward fn returned None)
      advantage       [B]    float  NaN where not computed yet
      step_version    [B, L] long   adapter version of the step that committed each position, when
                                    the sampler refreshed its adapter mid-rollout; None: every
                                    position's is ``policy_version`` (``versions()`` gives either)
    """

    kind: ClassVar[str] = "masked"   # what estimators build rows for and the store's layout is picked by: masked-diffusion steps
    prompt_ids: list[list[int]]
    completion_ids: Tensor
    step_map: Tensor
    logp: Tensor
    nfe: Tensor
    group_id: Tensor
    policy_version: Tensor
    reward: Tensor | None = None
    advantage: Tensor | None = None
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)
    sampler_hash: str = ""
    created_at: float = field(default_factory=time.time)
    step_version: Tensor | None = None

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        if self.step_version is not None and self.step_version.shape != self.completion_ids.shape:
            raise ValueError(f"TrajectoryBatch.step_version: expected shape {tuple(self.completion_ids.shape)}, "
                             f"got {tuple(self.step_version.shape)}")
        for name in ("completion_ids", "step_map", "logp"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != b:
                raise ValueError(f"TrajectoryBatch.{name}: expected shape [{b}, L], got {tuple(t.shape)}")
        if self.step_map.shape != self.completion_ids.shape or self.logp.shape != self.completion_ids.shape:
            raise ValueError("TrajectoryBatch: completion_ids, step_map and logp must share shape [B, L]")
        _per_row(self, ("nfe", "group_id", "policy_version"), b)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_len(self) -> int:
        return int(self.completion_ids.shape[1])

    @property
    def num_steps(self) -> Tensor:
        """[B] number of denoising steps each sequence took (max step index + 1)."""
        return self.step_map.max(dim=1).values + 1

    def versions(self) -> Tensor:
        """[B, L] the adapter version of the step that committed each position (``step_version``,
        or each row's ``policy_version`` when the sampler never refreshed mid-rollout)."""
        if self.step_version is not None:
            return self.step_version
        return self.policy_version[:, None].expand(self.completion_ids.shape)

    def select(self, idx: Tensor | list[int]) -> "TrajectoryBatch":
        """Row subset (used to drop zero-variance groups or stale rows)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        il = idx_t.tolist()
        assert self.reward is not None and self.advantage is not None
        return TrajectoryBatch(
            prompt_ids=[self.prompt_ids[i] for i in il],
            completion_ids=self.completion_ids[idx_t],
            step_map=self.step_map[idx_t],
            logp=self.logp[idx_t],
            nfe=self.nfe[idx_t],
            group_id=self.group_id[idx_t],
            policy_version=self.policy_version[idx_t],
            reward=self.reward[idx_t],
            advantage=self.advantage[idx_t],
            prompts=[self.prompts[i] for i in il] if self.prompts else [],
            completions=[self.completions[i] for i in il] if self.completions else [],
            meta=[self.meta[i] for i in il] if self.meta else [],
            sampler_hash=self.sampler_hash,
            created_at=self.created_at,
            step_version=self.step_version[idx_t] if self.step_version is not None else None,
        )

    @staticmethod
    def empty(completion_len: int, rows: int = 0, prompt_id: int = 0) -> "TrajectoryBatch":
        """``rows`` blank rows (default none): a learner rank's share of an update that holds none
        of its groups (a short last update, or its batches were dropped); it still takes part in
        the update's collectives. A sharded rank pads its passes with one blank row (prompt
        ``prompt_id``, no advantage), whose loss is multiplied by zero."""
        z = torch.zeros(rows, completion_len, dtype=torch.long)
        none = torch.zeros(rows, dtype=torch.long)
        return TrajectoryBatch([[prompt_id]] * rows, z, z.clone(), torch.zeros(rows, completion_len), none + 1,
                               none.clone(), none.clone(), torch.zeros(rows), torch.zeros(rows))

    @staticmethod
    def concat(batches: list["TrajectoryBatch"]) -> "TrajectoryBatch":
        """Concatenate batches with equal completion length (group ids must already be unique)."""
        if not batches:
            raise ValueError("TrajectoryBatch.concat: empty list")
        cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
        return TrajectoryBatch(
            prompt_ids=[p for b in batches for p in b.prompt_ids],
            completion_ids=cat("completion_ids"),
            step_map=cat("step_map"),
            logp=cat("logp"),
            nfe=cat("nfe"),
            group_id=cat("group_id"),
            policy_version=cat("policy_version"),
            reward=cat("reward"),
            advantage=cat("advantage"),
            prompts=[p for b in batches for p in b.prompts],
            completions=[c for b in batches for c in b.completions],
            meta=[m for b in batches for m in b.meta],
            sampler_hash=batches[0].sampler_hash,
            created_at=min(b.created_at for b in batches),
            step_version=(torch.cat([b.versions() for b in batches])
                          if any(b.step_version is not None for b in batches) else None),
        )


@dataclass
class RenoiseBatch:
    """Recorded trajectories of a renoising (uniform-noise) sampler: DiffusionGemma's entropy-bound
    chain (samplers/renoise.py), where a position can change at every step, so ``step_map`` cannot
    describe it. What is stored per step is the *action*: the accepted set and its sampled tokens
    with their behaviour log-probs. The rest of every state is renoise, uniform random tokens drawn
    from the row's own generator, which is environment randomness and is recorded by its seed:
    any state is rebuilt exactly by replaying the stream (``renoise.replay_states``).

    Shapes (B = sequences, K = the sampler's max steps, L = canvas length):
      prompt_ids      list of B lists of token ids
      completion_ids  [B, L] long   the output: argmax of the last step, pad after the first EOS
      accepted        [B, K, L] bool  positions accepted at step k (all False for k >= num_steps)
      tokens          [B, K, L] long  the sampled token at accepted positions (0 elsewhere)
      logp            [B, K, L] float behaviour log-prob of each accepted token (0 elsewhere)
      num_steps       [B]    long   denoiser calls of the row (its NFE); the last step's forward
                                    gives the output, so steps 0 .. num_steps - 2 carry actions
      seed            [B]    long   the row's generator seed (canvas init and renoise draws)
      group_id, policy_version, reward, advantage: as in :class:`TrajectoryBatch`
      sampler         the sampler's settings (config.RenoiseConfig as a dict): the learner scores
                      with the temperature schedule the batch was sampled with, never another
    """

    kind: ClassVar[str] = "renoise"  # what estimators build rows for and the store's layout is picked by: renoising chains
    prompt_ids: list[list[int]]
    completion_ids: Tensor
    accepted: Tensor
    tokens: Tensor
    logp: Tensor
    num_steps: Tensor
    seed: Tensor
    group_id: Tensor
    policy_version: Tensor
    reward: Tensor | None = None
    advantage: Tensor | None = None
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)
    sampler: dict[str, Any] = field(default_factory=dict)
    sampler_hash: str = ""
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        if self.completion_ids.dim() != 2 or self.completion_ids.shape[0] != b:
            raise ValueError(f"RenoiseBatch.completion_ids: expected shape [{b}, L], got {tuple(self.completion_ids.shape)}")
        k = int(self.accepted.shape[1]) if self.accepted.dim() == 3 else -1
        for name in ("accepted", "tokens", "logp"):
            t = getattr(self, name)
            if t.dim() != 3 or t.shape[0] != b or t.shape[2] != self.completion_len or t.shape[1] != k:
                raise ValueError(f"RenoiseBatch.{name}: expected shape [{b}, K, {self.completion_len}], "
                                 f"got {tuple(t.shape)}")
        _per_row(self, ("num_steps", "seed", "group_id", "policy_version"), b)
        if b and (int(self.num_steps.min()) < 1 or int(self.num_steps.max()) > k):
            raise ValueError(f"RenoiseBatch.num_steps: every row takes 1..{k} steps, got "
                             f"{self.num_steps.min()}..{self.num_steps.max()}")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_len(self) -> int:
        return int(self.completion_ids.shape[1])

    @property
    def max_steps(self) -> int:
        return int(self.accepted.shape[1])

    @property
    def nfe(self) -> Tensor:
        return self.num_steps

    def versions(self) -> Tensor:
        """[B, L] each output position's adapter version: the row's (a renoising chain never refreshes mid-chain)."""
        return self.policy_version[:, None].expand(self.completion_ids.shape)

    def select(self, idx: Tensor | list[int]) -> "RenoiseBatch":
        i = torch.as_tensor(idx, dtype=torch.long)
        il = i.tolist()
        assert self.reward is not None and self.advantage is not None
        pick = lambda xs: [xs[j] for j in il] if xs else []  # noqa: E731
        return RenoiseBatch(
            prompt_ids=pick(self.prompt_ids), completion_ids=self.completion_ids[i], accepted=self.accepted[i],
            tokens=self.tokens[i], logp=self.logp[i], num_steps=self.num_steps[i], seed=self.seed[i],
            group_id=self.group_id[i], policy_version=self.policy_version[i], reward=self.reward[i],
            advantage=self.advantage[i], prompts=pick(self.prompts), completions=pick(self.completions),
            meta=pick(self.meta), sampler=self.sampler, sampler_hash=self.sampler_hash, created_at=self.created_at)

    @staticmethod
    def concat(batches: list["RenoiseBatch"]) -> "RenoiseBatch":
        """Concatenate chains sampled with the same settings (so the same temperature schedule and
        max steps K) and canvas length; group ids must already be unique."""
        if not batches:
            raise ValueError("RenoiseBatch.concat: empty list")
        first = batches[0]
        for b in batches[1:]:
            if b.sampler != first.sampler or b.max_steps != first.max_steps or b.completion_len != first.completion_len:
                raise ValueError("RenoiseBatch.concat: batches sampled with other settings (renoise sampler, max "
                                 "steps or canvas length) cannot be scored as one update")
        cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
        join = lambda name: [x for b in batches for x in getattr(b, name)]  # noqa: E731
        return RenoiseBatch(
            prompt_ids=join("prompt_ids"), completion_ids=cat("completion_ids"), accepted=cat("accepted"),
            tokens=cat("tokens"), logp=cat("logp"), num_steps=cat("num_steps"), seed=cat("seed"),
            group_id=cat("group_id"), policy_version=cat("policy_version"), reward=cat("reward"),
            advantage=cat("advantage"), prompts=join("prompts"), completions=join("completions"), meta=join("meta"),
            sampler=first.sampler, sampler_hash=first.sampler_hash, created_at=min(b.created_at for b in batches))


class Batch(Protocol):
    """What the learner runtime, the store and the update engine read of any recorded batch
    (:class:`TrajectoryBatch`, :class:`RenoiseBatch`): its kind (which rows the estimators build,
    which layout the store writes), its rows' groups, versions, rewards and advantages, and how
    to take rows out of it and join several into one update."""

    kind: ClassVar[str]
    prompt_ids: list[list[int]]
    completion_ids: Tensor
    group_id: Tensor
    policy_version: Tensor
    reward: Tensor | None
    advantage: Tensor | None
    completions: list[str]

    def __len__(self) -> int: ...

    @property
    def completion_len(self) -> int: ...

    def select(self, idx: Tensor | list[int]) -> "Batch": ...

    def versions(self) -> Tensor:
        """[B, L] the adapter version behind each completion position (the step that decided it)."""
        ...

    @staticmethod
    def concat(batches: list[Any]) -> "Batch": ...
