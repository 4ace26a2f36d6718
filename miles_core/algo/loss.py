"""The objectives the estimators use, named by their form: a clipped token-ratio loss against the
proximal policy with a truncated importance weight against the behaviour policy (decoupled PPO,
as in AReaL: ADPO, d1's mean-field, coupled-GRPO), a ratio-free weighted likelihood (wd1, SPG),
and a sequence-ratio loss (ESPO, EBPO); each with an optional KL to the reference. Each returns
the loss and its stats (torchtune style), kept as tensors: the update engine adds them up on the
device and reads them back once per update, not seven host syncs per chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


SUM_KEYS = ("clip_frac", "approx_kl", "iw_mean", "kl_ref", "entropy")  # token sums; the mean is sum / tokens


@dataclass
class LossOut:
    loss: Tensor
    sums: dict[str, Tensor]  # detached 0-dim: SUM_KEYS summed over committed tokens, "tokens", "iw_max" (a max)

    @property
    def stats(self) -> dict[str, float]:
        """Per-token means as floats (a host sync each: for tests and one-off calls, not a loop)."""
        n = max(float(self.sums["tokens"]), 1.0)
        return {**{k: float(self.sums[k]) / n for k in SUM_KEYS}, "iw_max": float(self.sums["iw_max"]),
                "tokens": float(self.sums["tokens"])}


class TokenRatioLoss(nn.Module):
    """Per committed token i of row (trajectory b, step k):

        r_i = pi_theta / pi_prox,  w_i = min(pi_prox / mu, C)  (no gradient)
        l_i = -w_i * min(r_i A_b, clip(r_i, 1-eps, 1+eps) A_b) + beta * KL_k3(pi_theta || pi_ref)

    The loss is sum_i row_weight * l_i / normaliser: ``row_weight`` undoes step subsampling and
    ``normaliser`` is fixed per update (total completion tokens), so chunked backward passes add
    up to exactly the full-batch gradient.
    """

    ratio_free = False  # WeightedLikelihoodLoss: the same loss with -A_b log pi_theta as its per-token term

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
        per_tok = -adv * logp if self.ratio_free else -iw * surr
        kl = torch.zeros_like(logp)
        if ref_logp is not None and self.kl_coef > 0:
            d = ref_logp.detach() - logp
            kl = torch.exp(d) - d - 1  # k3 estimator, >= 0, unbiased for KL(pi_theta || pi_ref)
            per_tok = per_tok + self.kl_coef * kl
        w = m * row_weight[:, None]
        loss = (per_tok * w).sum() / normaliser
        n_tok = m.sum().clamp_min(1)
        ent_sum = (entropy * m).sum() if entropy is not None else torch.zeros((), device=logp.device)
        if entropy is not None and self.entropy_coef > 0 and self.entropy_floor > 0:
            # only pushes back when the policy gets more confident than the floor allows
            loss = loss + self.entropy_coef * torch.relu(self.entropy_floor - ent_sum / n_tok) * (n_tok / normaliser)
        with torch.no_grad():
            # tokens whose gradient the clip removed: ratio pushed past the trust region in A's direction
            clipped = (((ratio > 1 + self.clip_eps) & (adv > 0)) | ((ratio < 1 - self.clip_eps) & (adv < 0))).float()
            if self.ratio_free:
                clipped = torch.zeros_like(clipped)
            log_r = logp - prox_logp
            sums = {
                "clip_frac": (clipped * m).sum(),
                "approx_kl": (((ratio - 1) - log_r) * m).sum(),
                "iw_mean": (iw * m).sum(),
                "kl_ref": (kl * m).sum(),
                "entropy": ent_sum.detach(),
                "tokens": m.sum(),
                "iw_max": (iw_raw * m).amax() if m.numel() else torch.zeros((), device=logp.device),
            }
        return LossOut(loss=loss, sums=sums)


class WeightedLikelihoodLoss(TokenRatioLoss):
    """wd1's and SPG's form (arXiv:2507.08838; arXiv:2510.09541): l_i = -A_b log pi_theta + beta
    KL_k3, a likelihood weighted by the (transformed) advantage, with no ratio, no clip and no
    importance weight; the KL, entropy floor, normaliser and stats are :class:`TokenRatioLoss`'s
    (``clip_frac`` is 0, ``is_cap`` only enters the reported ``iw_mean``)."""

    ratio_free = True


class SequenceRatioLoss(nn.Module):
    """ESPO's sequence-level objective (arXiv:2512.03759, ML-GSAI/ESPO ``compute_loss``), and EBPO's
    with ``per_token=False`` (the exponent not divided by L; LLaDA2.1 Eq. 4-5): per row b,
    with s / s_prox [R, L] the tokens' ELBO terms under the current and the proximal policy,

        rho_b = exp(sum_l (s_bl - s_prox_bl) / L),   l_b = -min(rho_b A_b, clip(rho_b, 1-eps, 1+eps) A_b) L
                + beta (sum_l (s_bl - s_ref_bl))^2 / 2     (k2 on the sequence ELBOs)

    and the loss sum_b row_weight_b l_b / normaliser: with the engine's normaliser B L, that is
    ESPO's mean over sequences of the clipped term plus beta / (B L) times the k2 sum. Stats are
    per-row values counted once per scored token, so they average like the token-level ones."""

    def __init__(self, clip_eps: float = 0.2, kl_coef: float = 0.0, per_token: bool = True) -> None:
        super().__init__()
        self.clip_eps, self.kl_coef = clip_eps, kl_coef
        self.per_token = per_token  # ESPO: the log-ratio / L; EBPO (LLaDA2.1): the summed block ELBOs, not divided

    def forward(self, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantage: Tensor, commit: Tensor,
                row_weight: Tensor, normaliser: float, ref_logp: Tensor | None = None,
                entropy: Tensor | None = None) -> LossOut:
        """Same arguments as :class:`TokenRatioLoss` (``behav_logp`` and ``entropy`` unused: no recorded state)."""
        m = commit.float()
        length = m.shape[1]
        log_r = ((logp - prox_logp.detach()) * m).sum(1) / (length if self.per_token else 1)   # [R]
        ratio = torch.exp(log_r)
        surr = torch.minimum(ratio * advantage, ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * advantage)
        per_row = -surr * length
        kl = torch.zeros_like(ratio)
        if ref_logp is not None and self.kl_coef > 0:
            kl = 0.5 * (((logp - ref_logp.detach()) * m).sum(1)) ** 2
            per_row = per_row + self.kl_coef * kl
        loss = (per_row * row_weight).sum() / normaliser
        with torch.no_grad():
            clipped = (((ratio > 1 + self.clip_eps) & (advantage > 0)) | ((ratio < 1 - self.clip_eps) & (advantage < 0))).float()
            n = m.sum(1)
            sums = {"clip_frac": (clipped * n).sum(), "approx_kl": (((ratio - 1) - log_r) * n).sum(),
                    "iw_mean": n.sum(), "kl_ref": (kl * n).sum(), "entropy": torch.zeros((), device=logp.device),
                    "tokens": n.sum(), "iw_max": torch.ones((), device=logp.device)}
        return LossOut(loss=loss, sums=sums)
