"""Core data types shared by samplers, learners and storage.

A trajectory is stored in O(L) per sequence, never O(K*L): the intermediate state x_k of the
denoising chain is rebuilt from ``step_map`` (the step at which each completion position was
committed). See SCHEMA.md (miles_core/storage) for the stored layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


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
      policy_version  [B]    long   adapter version that sampled the row
      reward          [B]    float  NaN where not scored yet (or reward fn returned None)
      advantage       [B]    float  NaN where not computed yet
    """

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

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        for name in ("completion_ids", "step_map", "logp"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != b:
                raise ValueError(f"TrajectoryBatch.{name}: expected shape [{b}, L], got {tuple(t.shape)}")
        if self.step_map.shape != self.completion_ids.shape or self.logp.shape != self.completion_ids.shape:
            raise ValueError("TrajectoryBatch: completion_ids, step_map and logp must share shape [B, L]")
        for name in ("nfe", "group_id", "policy_version"):
            t = getattr(self, name)
            if t.shape != (b,):
                raise ValueError(f"TrajectoryBatch.{name}: expected shape [{b}], got {tuple(t.shape)}")
        if self.reward is None:
            self.reward = torch.full((b,), float("nan"))
        if self.advantage is None:
            self.advantage = torch.full((b,), float("nan"))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_len(self) -> int:
        return int(self.completion_ids.shape[1])

    @property
    def num_steps(self) -> Tensor:
        """[B] number of denoising steps each sequence took (max step index + 1)."""
        return self.step_map.max(dim=1).values + 1

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
        )

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
        )
