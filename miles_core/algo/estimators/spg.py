"""``spg``: SPG, Sandwiched Policy Gradient (Wang et al., 2025, arXiv:2510.09541; code
facebookresearch/SPG ``spg/spg_trainer.py``). REINFORCE with no ratio: a trajectory with A > 0
raises a lower bound of log pi (the ELBO), one with A <= 0 lowers an upper bound (the EUBO), or
``mix`` = w of it mixed with the ELBO. With J = ``copies`` masked copies,
m_jk = 1 where copy j masks token k and t_j = sum_k m_jk / L:

    ELBO  = (1/L) (1/J) sum_j sum_k m_jk log p_jk / t_j
    EUBO  = (1/(beta |K|)) sum_{k in K} log[(1/J) sum_j m_jk p_jk^beta / t_j]      K: tokens some copy masks
    loss  = -sum_b A_b L S_b / (B L),   S_b = ELBO if A_b > 0 else w EUBO + (1 - w) ELBO

Copies are block-wise (SPG's ``block_random``): a random block of ``mask_block`` tokens
(0: the completion is one block) has a uniform number 1..m of its tokens masked, every later
block is masked whole, earlier blocks stay clean. The prompt is masked with
``prompt_mask_prob`` as in d1; unlike SPG's code, that mask never reaches the completion.

Its settings are ``estimators.spg`` (config/estimators.py): ``copies`` (J), ``mask_block``,
``prompt_mask_prob``, ``eubo_beta`` and ``mix``; its loss is the ratio-free weighted likelihood (``loss.WeightedLikelihoodLoss``).

Within an update, the policy, the proximal policy and the reference see the same masks (common
random numbers: VRPO's "antithetic" sampling, LLaDA 1.5, arXiv:2505.19223); they are redrawn at
every epoch. The copy scorer they share is algo/elbo.py::CopyScorer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.elbo import CopyScorer, effective_block, one_row_each, uniform_subset
from miles_core.algo.loss import TokenRatioLoss, WeightedLikelihoodLoss
from miles_core.algo.draws import Draws
from miles_core.algo.rows import Rows, prompt_masks
from miles_core.config import SpgSettings, UpdateConfig
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def block_masks(gen: torch.Generator, shape: tuple[int, ...], length: int, block: int) -> Tensor:
    """SPG's block-wise copies [*shape, L]: in a uniform random block, a uniform count 1..m of its m
    tokens masked at random positions; every later block masked; earlier blocks clean."""
    block = effective_block(length, block)
    n_blocks = -(-length // block)
    pos = torch.arange(length)
    which = torch.randint(n_blocks, shape, generator=gen)[..., None]                  # [*shape, 1]
    start = which * block
    size = (torch.clamp(start + block, max=length) - start)                            # m of that block
    count = (torch.rand(size.shape, generator=gen) * size).long() + 1                 # 1..m
    inside = (pos >= start) & (pos < start + size)
    return uniform_subset(gen, (*shape, length), count, inside) | (pos >= start + size)


@dataclass
class SandwichRows(CopyScorer):
    """SPG: a row per trajectory; its per-token bound contributions s [R, L] sum to L S_b."""

    beta: float = 1.5
    mix: float = 0.5
    advantage: Tensor | None = None     # [B]: the sign picks the bound

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, None, Tensor]:
        logp, mask = self.copies(model, traj, step)                                     # [J, R, L]
        m = mask.float()
        length = m.shape[-1]
        t = m.sum(-1, keepdim=True).clamp_min(1) / length                                # [J, R, 1]
        elbo = (m * logp / t).mean(0)                                                    # [R, L]
        scored = m.amax(0) > 0                                                           # K
        avg = (m * torch.exp(self.beta * logp) / t).mean(0)
        size = scored.sum(-1, keepdim=True).clamp_min(1)
        eubo = torch.where(scored, torch.log(avg.clamp_min(1e-30)), 0.0) / self.beta * (length / size)
        neg = (self.advantage[traj] <= 0).to(logp.device)[:, None]
        return torch.where(neg, self.mix * eubo + (1 - self.mix) * elbo, elbo), None, scored


def spg_rows(sub: TrajectoryBatch, own: SpgSettings, epochs: int, tok: CharTokenizer, temperature: float,
             draws: Draws, model: Any = None) -> tuple[Rows, SandwichRows]:
    """One row per kept trajectory; its J block-wise copies and their prompt masks, drawn now."""
    b, n, length = len(sub), own.copies, sub.completion_len
    rows = one_row_each(b)
    comp = draws.cat(lambda _, g: block_masks(g, (epochs, n, 1), length, own.mask_block), dim=2)
    prompt = prompt_masks(sub, draws, epochs, n, own.prompt_mask_prob)
    return rows, SandwichRows(sub, tok, temperature, comp, prompt, beta=own.eubo_beta, mix=own.mix,
                              advantage=torch.nan_to_num(sub.advantage, nan=0.0))


@register_estimator("spg")
class SPG(Estimator):
    settings = SpgSettings

    builders = {"masked": spg_rows}  # batch kind -> its rows

    def loss(self, cfg: UpdateConfig) -> TokenRatioLoss:
        """REINFORCE on the bounds: no ratio, no clip, no importance weight."""
        return WeightedLikelihoodLoss(cfg.clip_eps, cfg.is_cap, cfg.kl_coef, cfg.entropy_floor, cfg.entropy_coef)
