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
* ``ebpo``: EBPO, LLaDA2.1's ELBO-based Block-level Policy Optimization (Bie et al., 2026,
  arXiv:2602.08676 §3.2, Eq. 4-5; the report gives no N, w_n, t_n or code, so the choices below
  follow DARE's reproduction, yjyddq/DARE ``dllm_core_algos.py::_forward_process_ebpo``). One
  PPO-clipped ratio per sequence, its log a sum of block-conditional ELBO differences:

      log rho_b = sum_n w_n sum_k sum_{l in block k} m_nkl (log p_theta - log p_prox)(y_l | z_nk) / p_nk

  N = ``adpo.mask_samples`` timesteps, w_n = 1/N; blocks of ``adpo.mask_block`` tokens (0: one
  block). Timestep n gives block k its own noise level t_nk = (u_n + k/K) mod 1 (stratified over
  the K blocks from one uniform offset), masking floor(t L_k) + 1 of its L_k tokens, p_nk that
  count / L_k. z_nk conditions block k on the clean blocks before it: LLaDA2.1 builds all K in one
  block-causal pass over [noisy, clean]; on a full-attention model the blocks after k are masked
  instead, one forward per (n, k). No per-token normalisation of the log-ratio (unlike ESPO); KL
  (``adpo.kl_coef``) is k2 on the summed ELBO difference, as for ESPO.

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


def effective_block(length: int, block: int) -> int:
    """``adpo.mask_block`` as the copies use it: 0 (or at least L) makes the completion one block."""
    return block if 0 < block < length else length


def uniform_subset(gen: torch.Generator, shape: tuple[int, ...], count: Tensor,
                   allowed: Tensor | None = None) -> Tensor:
    """[*shape] bool: ``count`` (broadcast against it) positions of the last dimension, uniform at
    random among ``allowed`` (default: all): the ``count`` smallest of uniform random keys."""
    keys = torch.rand(shape, generator=gen)
    if allowed is not None:
        keys = keys.masked_fill(~allowed, 2.0)
    return keys.argsort(-1).argsort(-1) < count


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


def stratified_masks(gen: torch.Generator, epochs: int, n: int, b: int, length: int) -> tuple[Tensor, Tensor]:
    """ESPO's copies [E, n, B, L] masking exactly x tokens, the counts x of a draw evenly spaced over
    0..L across the B trajectories from one uniform offset (LLaDA's stratified estimator), and t =
    x / (L + 1) [E, n, B]."""
    offset = torch.randint(length + 1, (epochs, n, 1), generator=gen).float()
    spread = torch.arange(b).float() * ((length + 1) / b)
    x = torch.round(offset + spread).long() % (length + 1)                             # [E, n, B]
    return uniform_subset(gen, (epochs, n, b, length), x[..., None]), x.float() / (length + 1)


def block_noise(gen: torch.Generator, shape: tuple[int, ...], length: int, block: int) -> tuple[Tensor, Tensor]:
    """EBPO's noised blocks: masks [*shape, K, L] (copy k masks only inside block k) and each
    block's masked fraction p [*shape, K]; block k's noise t = (u + k/K) mod 1 from one offset u
    per copy set, floor(t L_k) + 1 of its L_k tokens masked at uniform positions."""
    block = effective_block(length, block)
    n_blocks = -(-length // block)
    pos = torch.arange(length)
    start = torch.arange(n_blocks) * block
    size = torch.clamp(start + block, max=length) - start                               # [K] L_k
    t = (torch.rand((*shape, 1), generator=gen) + torch.arange(n_blocks) / n_blocks) % 1.0
    count = torch.minimum((t * size).floor().long() + 1, size)                         # [*shape, K]
    inside = (pos >= start[:, None]) & (pos < (start + size)[:, None])                 # [K, L]
    return uniform_subset(gen, (*shape, n_blocks, length), count[..., None], inside), count.float() / size.float()


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


@dataclass
class BlockELBORows(CopyScorer):
    """EBPO: a row per trajectory; s [R, L] are the tokens' block-ELBO terms (the log-ratio's
    estimate is the sum of s - s_prox). ``comp_masks`` [E, N, B, K, L], ``frac`` [E, N, B, K]."""

    frac: Tensor | None = None
    block: int = 0                      # tokens per block (the last may be shorter)

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, None, Tensor]:
        masks, frac = self.comp_masks[self.epoch][:, traj], self.frac[self.epoch][:, traj]  # [N, R, K, L], [N, R, K]
        n_t, _, n_blocks, length = masks.shape
        block_of = torch.arange(length) // self.block                                   # [L]
        s = torch.zeros(())
        for n in range(n_t):
            for k in range(n_blocks):  # z_nk: blocks before k clean, block k noised, blocks after k masked
                logp, _, m = score_rows(model, self.batch, traj, step, self.tok, self.temperature, "coupled",
                                        comp_mask=masks[n, :, k] | (block_of > k)[None], scored=masks[n, :, k])
                s = s + torch.where(m, logp / frac[n, :, k].to(logp.device)[:, None], 0.0) / n_t
        return s, None, torch.ones_like(s, dtype=torch.bool)

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] positions a row's N x K forwards hold (sequence plus half a block's logits each)."""
        n_t, n_blocks = self.comp_masks.shape[1], self.comp_masks.shape[3]
        per = seq_len(self.batch) + head * self.block / 2
        return torch.full((traj.numel(),), float(n_t * n_blocks * per))


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
    if cfg.estimator == "ebpo":
        comp, frac = block_noise(generator, (cfg.epochs, n, b), length, cfg.mask_block)
        block = effective_block(length, cfg.mask_block)
        return rows, BlockELBORows(sub, tok, temperature, comp, frac=frac, block=block)
    comp, t = stratified_masks(generator, cfg.epochs, n, b, length)
    return rows, SequenceELBORows(sub, tok, temperature, comp, t=t)
