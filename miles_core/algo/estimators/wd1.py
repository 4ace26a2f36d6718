"""``wd1`` (Tang et al., 2025, arXiv:2507.08838; code xiaohangt/wd1): d1's rows (meanfield.py),
each trajectory weighted by w = softmax(A) - softmax(-A) within its group, with a ratio-free loss
-w log p: a weighted likelihood, no clip and no importance weight.

Its settings are ``estimators.wd1`` (config/estimators.py): ``mask_draws`` and ``prompt_mask_prob`` (through d1's rows).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from miles_core.algo.advantages import wd1_weights
from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.estimators.meanfield import meanfield_rows
from miles_core.algo.loss import TokenRatioLoss, WeightedLikelihoodLoss
from miles_core.config import UpdateConfig, Wd1Settings


@register_estimator("wd1")
class WD1(Estimator):
    whole_groups = True  # its weights are a softmax over each group
    settings = Wd1Settings

    builders = {"masked": meanfield_rows}  # batch kind -> its rows

    def loss(self, cfg: UpdateConfig) -> TokenRatioLoss:
        return WeightedLikelihoodLoss(cfg.clip_eps, cfg.is_cap, cfg.kl_coef, cfg.entropy_floor, cfg.entropy_coef)

    def advantages(self, adv: Tensor, batch: Any) -> Tensor:
        """[B] softmax(A) - softmax(-A) over each group (``batch.group_id``)."""
        return wd1_weights(adv, batch.group_id)
