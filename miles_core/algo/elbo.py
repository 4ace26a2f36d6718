"""What the ELBO-based estimators share (algo/estimators/spg.py, espo.py, ebpo.py): the likelihood of
a completion is not recorded step by step but bounded by Monte-Carlo masked copies of it, scored
in one pass each; here are the mask draws they build on and the scorer of a row's copies.

Within an update, the policy, the proximal policy and the reference see the same masks
(common random numbers: VRPO's "antithetic" sampling, LLaDA 1.5, arXiv:2505.19223); the masks are
redrawn at every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.rows import MaskedCopy, Rows, score_rows, seq_len
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def effective_block(length: int, block: int) -> int:
    """A ``mask_block`` setting (SPG's, EBPO's) as the copies use it: 0 (or at least L) makes the completion one block."""
    return block if 0 < block < length else length


def uniform_subset(gen: torch.Generator, shape: tuple[int, ...], count: Tensor,
                   allowed: Tensor | None = None) -> Tensor:
    """[*shape] bool: ``count`` (broadcast against it) positions of the last dimension, uniform at
    random among ``allowed`` (default: all): the ``count`` smallest of uniform random keys."""
    keys = torch.rand(shape, generator=gen)
    if allowed is not None:
        keys = keys.masked_fill(~allowed, 2.0)
    return keys.argsort(-1).argsort(-1) < count


MASKED_COPY = MaskedCopy()


def one_row_each(b: int) -> Rows:
    """One row per kept trajectory, weight 1: its copies are all scored inside that row."""
    return Rows(torch.arange(b), torch.zeros(b, dtype=torch.long), torch.ones(b))


@dataclass
class CopyScorer:
    """Shared by the ELBO estimators: the epoch's masked copies of each row's completion, scored one copy at a time."""

    batch: TrajectoryBatch
    tok: CharTokenizer
    temperature: float
    comp_masks: Tensor                  # [E, J, B, L]
    prompt_masks: Tensor | None = None  # [E, J, B, P]
    epoch: int = 0
    per_epoch = True                    # fresh masks every epoch: the proximal policy is rescored per epoch
    forwards_per_mask = 1               # ESPO: 2 (a mask and its complement)

    @property
    def width(self) -> int:
        return self.batch.completion_len

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def copies(self, model: Any, traj: Tensor, step: Tensor, masks: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """log p of every token at the positions each copy masks, zero elsewhere, and the masks:
        [J, R, L] each. ``masks`` [J, B, L]: other copies than the epoch's (ESPO's complements)."""
        masks = self.comp_masks[self.epoch] if masks is None else masks
        lps, ms = [], []
        for j in range(masks.shape[0]):
            pm = self.prompt_masks[self.epoch, j][traj] if self.prompt_masks is not None else None
            logp, _, m = score_rows(model, self.batch, traj, step, self.tok, self.temperature, MASKED_COPY, pm,
                                    masks[j][traj])
            lps.append(logp)
            ms.append(m)
        return torch.stack(lps), torch.stack(ms)

    def behaviour(self, traj: Tensor, step: Tensor) -> None:
        return None  # scored outside any recorded state: no behaviour policy, the ratio is against prox

    def versions(self, traj: Tensor, step: Tensor) -> Tensor:
        """A row scores copies of the whole completion: as old as its trajectory's oldest step."""
        return self.batch.policy_version[traj]

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] positions a row's J forwards hold (sequence plus half the completion's logits each)."""
        forwards = self.forwards_per_mask * self.comp_masks.shape[1]
        return torch.full((traj.numel(),), float(forwards * (seq_len(self.batch) + head * self.width / 2)))
