"""ELBO-based estimators: the likelihood of a completion is not recorded step by step but bounded
by Monte-Carlo masked copies of it, scored in one pass each.

* ``spg``: SPG, Sandwiched Policy Gradient (Wang et al., 2025, arXiv:2510.09541; code
  facebookresearch/SPG ``spg/spg_trainer.py``). REINFORCE with no ratio: a trajectory with A > 0
  raises a lower bound of log pi (the ELBO), one with A <= 0 lowers an upper bound (the EUBO), or
  ``adpo.spg_mix`` = w of it mixed with the ELBO. With J = ``adpo.mask_samples`` masked copies,
  m_jk = 1 where copy j masks token k and t_j = sum_k m_jk / L:

      ELBO  = (1/L) (1/J) sum_j sum_k m_jk log p_jk / t_j
      EUBO  = (1/(beta |K|)) sum_{k in K} log[(1/J) sum_j m_jk p_jk^beta / t_j]      K: tokens some copy masks
      loss  = -sum_b A_b L S_b / (B L),   S_b = ELBO if A_b > 0 else w EUBO + (1 - w) ELBO

  Copies are block-wise (SPG's ``block_random``): a random block of ``adpo.mask_block`` tokens
  (0: the completion is one block) has a uniform number 1..m of its tokens masked, every later
  block is masked whole, earlier blocks stay clean. The prompt is masked with
  ``adpo.prompt_mask_prob`` as in d1; unlike SPG's code, that mask never reaches the completion.
* ``espo``: ESPO (Ou et al., 2025, arXiv:2512.03759; code ML-GSAI/ESPO ``espo/espo_trainer.py``):
  one PPO-clipped ratio per sequence, rho_b = exp((ELBO_theta - ELBO_prox) / L), the ELBO from
  ``adpo.mask_samples`` coupled pairs: a copy masking exactly x tokens (x stratified over the
  batch's trajectories in 0..L, t = x / (L + 1), weight 1/t) and its complement (weight 1/(1 - t)),
  averaged, so every token is scored once per pair. KL (``adpo.kl_coef``) is ESPO's k2 on the
  sequence ELBO difference to the reference.

Within an update, the policy, the proximal policy and the reference see the same masks
(common random numbers: VRPO's "antithetic" sampling, LLaDA 1.5, arXiv:2505.19223); the masks are
redrawn at every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.rows import Rows, score_rows, seq_len
from miles_core.config import ADPOConfig
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def block_masks(gen: torch.Generator, shape: tuple[int, ...], length: int, block: int) -> Tensor:
    """SPG's block-wise copies [*shape, L]: in a uniform random block, a uniform count 1..m of its m
    tokens masked at random positions; every later block masked; earlier blocks clean."""
    block = block if 0 < block < length else length
    n_blocks = -(-length // block)
    pos = torch.arange(length)
    which = torch.randint(n_blocks, shape, generator=gen)[..., None]                  # [*shape, 1]
    start = which * block
    size = (torch.clamp(start + block, max=length) - start)                            # m of that block
    count = (torch.rand(size.shape, generator=gen) * size).long() + 1                 # 1..m
    # a uniform subset of `count` positions inside the block: the `count` smallest random keys
    keys = torch.rand((*shape, length), generator=gen).masked_fill((pos < start) | (pos >= start + size), 2.0)
    rank = keys.argsort(-1).argsort(-1)
    return (rank < count) | (pos >= start + size)


def stratified_masks(gen: torch.Generator, epochs: int, n: int, b: int, length: int) -> tuple[Tensor, Tensor]:
    """ESPO's copies [E, n, B, L] masking exactly x tokens, the counts x of a draw evenly spaced over
    0..L across the B trajectories from one uniform offset (LLaDA's stratified estimator), and t =
    x / (L + 1) [E, n, B]."""
    offset = torch.randint(length + 1, (epochs, n, 1), generator=gen).float()
    spread = torch.arange(b).float() * ((length + 1) / b)
    x = torch.round(offset + spread).long() % (length + 1)                             # [E, n, B]
    rank = torch.rand((epochs, n, b, length), generator=gen).argsort(-1).argsort(-1)
    return rank < x[..., None], x.float() / (length + 1)


@dataclass
class CopyScorer:
    """Shared by both: the epoch's masked copies of each row's completion, scored one copy at a time."""

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
            logp, _, m = score_rows(model, self.batch, traj, step, self.tok, self.temperature, "coupled", pm,
                                    masks[j][traj])
            lps.append(logp)
            ms.append(m)
        return torch.stack(lps), torch.stack(ms)

    def behaviour(self, traj: Tensor, step: Tensor) -> None:
        return None  # scored outside any recorded state: no behaviour policy, the ratio is against prox

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] positions a row's J forwards hold (sequence plus half the completion's logits each)."""
        forwards = self.forwards_per_mask * self.comp_masks.shape[1]
        return torch.full((traj.numel(),), float(forwards * (seq_len(self.batch) + head * self.width / 2)))


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


@dataclass
class SequenceELBORows(CopyScorer):
    """ESPO: a row per trajectory; s [R, L] are the tokens' ELBO terms (the ELBO is their sum)."""

    t: Tensor | None = None             # [E, n, B]: each copy's masked fraction
    forwards_per_mask = 2

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, None, Tensor]:
        pair = self.comp_masks[self.epoch]                                               # [n, B, L]
        logp, m = self.copies(model, traj, step, torch.cat([pair, ~pair]))               # [2n, R, L]: M_i, then ~M_i
        length = m.shape[-1]
        x = self.t[self.epoch][:, traj].to(logp.device)[..., None] * (length + 1)        # [n, R, 1] masked counts
        frac = torch.cat([x, length - x]) / (length + 1)                                 # ESPO's weights: 1/t, 1/(L/(L+1) - t)
        terms = torch.where(m, logp / frac.clamp_min(1e-9), 0.0)
        s = terms.view(2, -1, *terms.shape[1:]).sum(0).mean(0) / 2                       # [R, L]: pair mean, copy mean
        return s, None, torch.ones_like(s, dtype=torch.bool)


def elbo_rows(sub: TrajectoryBatch, cfg: ADPOConfig, tok: CharTokenizer, temperature: float,
              generator: torch.Generator) -> tuple[Rows, CopyScorer]:
    """One row per kept trajectory and its scorer, every mask drawn now in a fixed order."""
    b, n, length = len(sub), cfg.mask_samples, sub.completion_len
    rows = Rows(torch.arange(b), torch.zeros(b, dtype=torch.long), torch.ones(b))
    if cfg.estimator == "spg":
        comp = block_masks(generator, (cfg.epochs, n, b), length, cfg.mask_block)
        width = max(len(p) for p in sub.prompt_ids)
        prompt = torch.rand(cfg.epochs, n, b, width, generator=generator) < cfg.prompt_mask_prob
        return rows, SandwichRows(sub, tok, temperature, comp, prompt, beta=cfg.eubo_beta, mix=cfg.spg_mix,
                                  advantage=torch.nan_to_num(sub.advantage, nan=0.0))
    comp, t = stratified_masks(generator, cfg.epochs, n, b, length)
    return rows, SequenceELBORows(sub, tok, temperature, comp, t=t)
