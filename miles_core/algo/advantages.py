"""Group-relative advantages (GRPO style) over the G samples of one prompt."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(reward: Tensor, group_id: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """A_i = r_i - mean(r over i's group), optionally divided by the group's std.

    reward [B] (NaN = unscored, treated as 0 reward), group_id [B] -> advantage [B].
    A group whose rewards are all equal gets A = 0 exactly: it carries no signal.
    """
    r = torch.nan_to_num(reward.float(), nan=0.0)
    _, inv = torch.unique(group_id, return_inverse=True)
    g = int(inv.max()) + 1
    count = torch.zeros(g).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g).index_add_(0, inv, r) / count
    adv = r - mean[inv]
    if std_normalize:
        var = torch.zeros(g).index_add_(0, inv, adv**2) / (count - 1).clamp_min(1)
        adv = adv / (var.sqrt()[inv] + eps)
    return adv


def zero_variance_groups(reward: Tensor, group_id: Tensor) -> Tensor:
    """[B] bool: True where the row's group has identical rewards (skipped by the learner)."""
    r = torch.nan_to_num(reward.float(), nan=0.0)
    out = torch.zeros_like(r, dtype=torch.bool)
    for g in torch.unique(group_id):
        m = group_id == g
        out[m] = bool((r[m] == r[m][0]).all())
    return out


def wd1_weights(advantage: Tensor, group_id: Tensor) -> Tensor:
    """wd1's per-completion weight (Tang et al., 2025, arXiv:2507.08838; xiaohangt/wd1's
    ``rev_grpo_trainer.py``): softmax(A) - softmax(-A) within each group, so the objective
    sum_i w_i log p(o_i) raises the likelihood of the better completions and lowers that of the
    worse ones without a ratio. For a group of two with A = +-a this is +-tanh(a).

    advantage [B], group_id [B] -> weight [B]; every group's weights sum to 0."""
    _, inv = torch.unique(group_id, return_inverse=True)
    out = torch.zeros_like(advantage, dtype=torch.float32)
    for g in range(int(inv.max()) + 1):
        m = inv == g
        a = advantage[m].float()
        out[m] = torch.softmax(a, 0) - torch.softmax(-a, 0)
    return out
