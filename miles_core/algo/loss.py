"""The ADPO token-level objective: clipped ratio against the proximal policy, truncated
importance weight against the behaviour policy (decoupled PPO, as in AReaL), optional KL to the
reference, optional entropy floor. Returns the loss and its stats (torchtune style)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class LossOut:
    loss: Tensor
    stats: dict[str, float]


class ADPOLoss(nn.Module):
    """Per committed token i of row (trajectory b, step k):

        r_i = pi_theta / pi_prox,  w_i = min(pi_prox / mu, C)  (no gradient)
        l_i = -w_i * min(r_i A_b, clip(r_i, 1-eps, 1+eps) A_b) + beta * KL_k3(pi_theta || pi_ref)

    The loss is sum_i row_weight * l_i / normaliser: ``row_weight`` undoes step subsampling and
    ``normaliser`` is fixed per update (total completion tokens), so chunked backward passes add
    up to exactly the full-batch gradient.
    """

    def __init__(self, clip_eps: float = 0.2, is_cap: float = 2.0, kl_coef: float = 0.0,
                 entropy_floor: float = 0.0, entropy_coef: float = 0.0) -> None:
        super().__init__()
        self.clip_eps, self.is_cap, self.kl_coef = clip_eps, is_cap, kl_coef
        self.entropy_floor, self.entropy_coef = entropy_floor, entropy_coef

    def forward(self, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantage: Tensor, commit: Tensor,
                row_weight: Tensor, normaliser: float, ref_logp: Tensor | None = None,
                entropy: Tensor | None = None) -> LossOut:
        """logp/prox_logp/behav_logp/commit [R, L]; advantage/row_weight [R]; ref_logp/entropy [R, L]."""
        m = commit.float()
        adv = advantage[:, None]
        ratio = torch.exp(logp - prox_logp.detach())
        iw_raw = torch.exp(prox_logp.detach() - behav_logp)
        iw = iw_raw.clamp(max=self.is_cap)
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv)
        per_tok = -iw * surr
        kl = torch.zeros_like(logp)
        if ref_logp is not None and self.kl_coef > 0:
            d = ref_logp.detach() - logp
            kl = torch.exp(d) - d - 1  # k3 estimator, >= 0, unbiased for KL(pi_theta || pi_ref)
            per_tok = per_tok + self.kl_coef * kl
        w = m * row_weight[:, None]
        loss = (per_tok * w).sum() / normaliser
        n_tok = m.sum().clamp_min(1)
        ent_mean = torch.tensor(0.0)
        if entropy is not None:
            ent_mean = (entropy * m).sum() / n_tok
            if self.entropy_coef > 0 and self.entropy_floor > 0:
                # only pushes back when the policy gets more confident than the floor allows
                loss = loss + self.entropy_coef * torch.relu(self.entropy_floor - ent_mean) * (n_tok / normaliser)
        with torch.no_grad():
            # tokens whose gradient the clip removed: ratio pushed past the trust region in A's direction
            clipped = (((ratio > 1 + self.clip_eps) & (adv > 0)) | ((ratio < 1 - self.clip_eps) & (adv < 0))).float()
            log_r = logp - prox_logp
            stats = {
                "clip_frac": float((clipped * m).sum() / n_tok),
                "approx_kl": float((((ratio - 1) - log_r) * m).sum() / n_tok),
                "iw_mean": float((iw * m).sum() / n_tok),
                "iw_max": float((iw_raw * m).max()) if m.any() else 0.0,
                "kl_ref": float((kl * m).sum() / n_tok),
                "entropy": float(ent_mean),
                "tokens": float(m.sum()),
            }
        return LossOut(loss=loss, stats=stats)
