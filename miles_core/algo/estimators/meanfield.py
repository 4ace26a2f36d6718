"""``meanfield``: d1 / diffu-GRPO (Zhao et al., 2025, arXiv:2504.12216), the mean-field baseline on
the same samples. One row per trajectory and mask draw: the completion fully masked and a random
fraction ``prompt_mask_prob`` of the prompt masked, every token scored in one pass. A fresh
prompt mask at every inner iteration (epoch), as d1 draws one per iteration; ``mask_draws``
= n draws per trajectory, each a row of weight 1/n.

Its tokens are scored outside any recorded state, so the ratio is against the policy before the
update and there is no importance weight (behaviour = prox). wd1 (wd1.py) scores these rows too.

Its settings are ``estimators.meanfield`` (config/estimators.py): ``mask_draws`` and ``prompt_mask_prob``.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.draws import Draws
from miles_core.algo.rows import FullyMasked, MaskedStepRows, Rows, prompt_masks
from miles_core.config import MeanFieldSettings
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def draw_rows(b: int, n: int, per_draw: int = 1) -> Rows:
    """``per_draw`` rows for each of n Monte-Carlo draws of each of b trajectories, weight 1/n; a
    row's step is its draw (per_draw x draw + which of its rows)."""
    return Rows(torch.arange(b).repeat_interleave(per_draw * n), torch.arange(per_draw * n).repeat(b),
                torch.full((per_draw * b * n,), 1 / n))


def meanfield_rows(sub: TrajectoryBatch, own: MeanFieldSettings, epochs: int, tok: CharTokenizer,
                   temperature: float, draws: Draws, model: Any = None) -> tuple[Rows, MaskedStepRows]:
    """n rows per trajectory and their prompt masks [E, n, B, P], drawn now."""
    b, n = len(sub), own.mask_draws
    masks = prompt_masks(sub, draws, epochs, n, own.prompt_mask_prob)
    return draw_rows(b, n), MaskedStepRows(sub, tok, temperature, FullyMasked(), prompt_masks=masks)


@register_estimator("meanfield")
class MeanField(Estimator):
    settings = MeanFieldSettings

    builders = {"masked": meanfield_rows}  # batch kind -> its rows
