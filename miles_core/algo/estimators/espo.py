"""``espo``: ESPO (Ou et al., 2025, arXiv:2512.03759; code ML-GSAI/ESPO ``espo/espo_trainer.py``):
one PPO-clipped ratio per sequence, rho_b = exp((ELBO_theta - ELBO_prox) / L), the ELBO from
``pairs`` coupled pairs: a copy masking exactly x tokens (x stratified over the
batch's trajectories in 0..L, t = x / (L + 1), weight 1/t) and its complement (weight 1/(1 - t)),
averaged, so every token is scored once per pair. KL (``update.kl_coef``) is ESPO's k2 on the
sequence ELBO difference to the reference.

Its settings are ``estimators.espo`` (config/estimators.py): ``pairs`` (coupled pairs); its loss
is :class:`~miles_core.algo.loss.SequenceRatioLoss` with the log-ratio divided by L (``per_token``).

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
from miles_core.algo.elbo import CopyScorer, one_row_each, uniform_subset
from miles_core.algo.loss import SequenceRatioLoss
from miles_core.algo.draws import STREAM_GROUP, Draws
from miles_core.algo.rows import Rows
from miles_core.config import EspoSettings, UpdateConfig
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def stratified_masks(gen: torch.Generator, epochs: int, n: int, b: int, length: int) -> tuple[Tensor, Tensor]:
    """ESPO's copies [E, n, B, L] masking exactly x tokens, the counts x of a draw evenly spaced over
    0..L across B trajectories (one group) from one uniform offset (LLaDA's stratified estimator),
    and t = x / (L + 1) [E, n, B]."""
    offset = torch.randint(length + 1, (epochs, n, 1), generator=gen).float()
    spread = torch.arange(b).float() * ((length + 1) / b)
    x = torch.round(offset + spread).long() % (length + 1)                             # [E, n, B]
    return uniform_subset(gen, (epochs, n, b, length), x[..., None]), x.float() / (length + 1)


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


def espo_rows(sub: TrajectoryBatch, own: EspoSettings, epochs: int, tok: CharTokenizer, temperature: float,
              draws: Draws, model: Any = None) -> tuple[Rows, SequenceELBORows]:
    """One row per kept trajectory; its stratified copies (each pair's first half) drawn now. The
    counts are stratified over each group's kept members (a group is never split between learner
    ranks, learner/shares.py), from an offset its first member draws: the same in any batch."""
    b, n, length = len(sub), own.pairs, sub.completion_len
    rows = one_row_each(b)
    comp = torch.empty(epochs, n, b, length, dtype=torch.bool)
    t = torch.empty(epochs, n, b)
    for g in sub.group_id.unique().tolist():
        idx = (sub.group_id == g).nonzero().squeeze(1)
        comp[:, :, idx], t[:, :, idx] = stratified_masks(draws.gen(int(idx[0]), STREAM_GROUP), epochs, n,
                                                         idx.numel(), length)
    return rows, SequenceELBORows(sub, tok, temperature, comp, t=t)


@register_estimator("espo")
class ESPO(Estimator):
    settings = EspoSettings
    whole_groups = True  # its copies' counts are stratified over each group

    builders = {"masked": espo_rows}  # batch kind -> its rows

    def loss(self, cfg: UpdateConfig) -> SequenceRatioLoss:
        """One clipped ratio per sequence, its exponent per token (divided by L)."""
        return SequenceRatioLoss(cfg.clip_eps, cfg.kl_coef, per_token=True)
