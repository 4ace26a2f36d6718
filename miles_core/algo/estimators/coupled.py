"""``coupled``: DiffuCoder's coupled-GRPO (Gong et al., 2025, arXiv:2506.20639). Two rows per
trajectory and mask draw: a random mask M (each token masked with probability t ~ U(0, 1)) and
its complement, so every completion token is scored exactly once per pair; redrawn every epoch,
``mask_draws`` = n pairs per trajectory, each row of weight 1/n.

Its tokens are scored outside any recorded state, so the ratio is against the policy before the
update and there is no importance weight (behaviour = prox).

Its settings are ``estimators.coupled`` (config/estimators.py): ``mask_draws``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles_core.algo.draws import Draws
from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.estimators.meanfield import draw_rows
from miles_core.algo.rows import MaskedCopy, MaskedStepRows, Rows
from miles_core.config import CoupledSettings
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def coupled_rows(sub: TrajectoryBatch, own: CoupledSettings, epochs: int, tok: CharTokenizer, temperature: float,
                 draws: Draws, model: Any = None) -> tuple[Rows, MaskedStepRows]:
    """2n rows per trajectory (row 2i: M_i, row 2i + 1: ~M_i) and the masks M [E, n, B, L], drawn now,
    each trajectory from its own generator: each draw's level t [E, n, 1, 1] first, then its tokens."""
    b, n, e, length = len(sub), own.mask_draws, epochs, sub.completion_len

    def one(_: int, g: torch.Generator) -> Tensor:
        t = torch.rand(e, n, 1, 1, generator=g)
        return torch.rand(e, n, 1, length, generator=g) < t

    comp = draws.cat(one, dim=2)
    return draw_rows(b, n, per_draw=2), MaskedStepRows(sub, tok, temperature, MaskedCopy(), comp_masks=comp)


@register_estimator("coupled")
class Coupled(Estimator):
    settings = CoupledSettings

    builders = {"masked": coupled_rows}  # batch kind -> its rows
