"""``ebpo``: EBPO, LLaDA2.1's ELBO-based Block-level Policy Optimization (Bie et al., 2026,
arXiv:2602.08676 §3.2, Eq. 4-5; the report gives no N, w_n, t_n or code, so the choices below
follow DARE's reproduction, yjyddq/DARE ``dllm_core_algos.py::_forward_process_ebpo``). One
PPO-clipped ratio per sequence, its log a sum of block-conditional ELBO differences:

    log rho_b = sum_n w_n sum_k sum_{l in block k} m_nkl (log p_theta - log p_prox)(y_l | z_nk) / p_nk

N = ``timesteps`` timesteps, w_n = 1/N; blocks of ``mask_block`` tokens (0: one
block). Timestep n gives block k its own noise level t_nk = (u_n + k/K) mod 1 (stratified over
the K blocks from one uniform offset), masking floor(t L_k) + 1 of its L_k tokens, p_nk that
count / L_k. z_nk conditions block k on the clean blocks before it: LLaDA2.1 builds all K in one
block-causal pass over [noisy, clean]; on a full-attention model the blocks after k are masked
instead, one forward per (n, k). No per-token normalisation of the log-ratio (unlike ESPO); KL
(``update.kl_coef``) is k2 on the summed ELBO difference, as for ESPO.

Its settings are ``estimators.ebpo`` (config/estimators.py): ``timesteps`` (N) and ``mask_block``;
its loss is :class:`~miles_core.algo.loss.SequenceRatioLoss` with the log-ratio not divided by L.

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
from miles_core.algo.elbo import MASKED_COPY, CopyScorer, effective_block, one_row_each, uniform_subset
from miles_core.algo.loss import SequenceRatioLoss
from miles_core.algo.draws import Draws
from miles_core.algo.rows import Rows, score_rows, seq_len
from miles_core.config import EbpoSettings, UpdateConfig
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


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
                logp, _, m = score_rows(model, self.batch, traj, step, self.tok, self.temperature, MASKED_COPY,
                                        comp_mask=masks[n, :, k] | (block_of > k)[None], scored=masks[n, :, k])
                s = s + torch.where(m, logp / frac[n, :, k].to(logp.device)[:, None], 0.0) / n_t
        return s, None, torch.ones_like(s, dtype=torch.bool)

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] positions a row's N x K forwards hold (sequence plus half a block's logits each)."""
        n_t, n_blocks = self.comp_masks.shape[1], self.comp_masks.shape[3]
        per = seq_len(self.batch) + head * self.block / 2
        return torch.full((traj.numel(),), float(n_t * n_blocks * per))


def ebpo_rows(sub: TrajectoryBatch, own: EbpoSettings, epochs: int, tok: CharTokenizer, temperature: float,
              draws: Draws, model: Any = None) -> tuple[Rows, BlockELBORows]:
    """One row per kept trajectory; its N timesteps' noised blocks drawn now, each trajectory's
    from its own generator."""
    b, n, length = len(sub), own.timesteps, sub.completion_len
    rows = one_row_each(b)
    each = [block_noise(draws.gen(i), (epochs, n, 1), length, own.mask_block) for i in range(b)]
    comp, frac = torch.cat([c for c, _ in each], 2), torch.cat([f for _, f in each], 2)
    block = effective_block(length, own.mask_block)
    return rows, BlockELBORows(sub, tok, temperature, comp, frac=frac, block=block)


@register_estimator("ebpo")
class EBPO(Estimator):
    settings = EbpoSettings

    builders = {"masked": ebpo_rows}  # batch kind -> its rows

    def loss(self, cfg: UpdateConfig) -> SequenceRatioLoss:
        """One clipped ratio per sequence, its exponent the summed block ELBO difference."""
        return SequenceRatioLoss(cfg.clip_eps, cfg.kl_coef, per_token=False)
