"""``adpo`` (the default): ADPO's rows are the recorded denoising steps themselves. Row (b, k) is
the state before step k, rebuilt from ``step_map``, scoring the tokens committed at k against their
stored behaviour log-probs: the recorded trajectory's own likelihood, with an importance weight
min(pi_prox / mu, ``adpo.is_cap``) for stale samples. ``adpo.step_fraction`` = rho scores a random
fraction of each trajectory's steps, reweighted by K_b / m_b so the objective stays unbiased.

``adpo.step_merge`` = s > 1 is TraceRL's shrinkage (Wang et al., 2025, arXiv:2509.06949): s
consecutive steps form one row scored at the first one's state, s times fewer forwards, its ratio
against the proximal policy (the later steps' tokens are scored at an earlier state than the one
they were sampled from).

The one estimator with rows for a renoising chain (DiffusionGemma, algo/renoise_rows.py): its
steps are recorded actions too, whereas there is no masked state to take an ELBO over.

Reads ``adpo.step_fraction``, ``adpo.step_merge`` and ``adpo.is_cap``.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.renoise_rows import RenoiseStepRows, renoise_rows
from miles_core.algo.rows import MaskedStepRows, RecordedStep, Rows, build_rows
from miles_core.config import ADPOConfig
from miles_core.tokenizer import CharTokenizer
from miles_core.types import RenoiseBatch, TrajectoryBatch


def step_rows(sub: TrajectoryBatch, cfg: ADPOConfig, tok: CharTokenizer, temperature: float,
              generator: torch.Generator, model: Any = None) -> tuple[Rows, MaskedStepRows]:
    """The (b, k) rows (a fraction rho of them, s steps per row) and their scorer."""
    rows = build_rows(sub, cfg.step_fraction, generator, cfg.step_merge)
    prompt_width = max(len(p) for p in sub.prompt_ids)
    torch.rand(len(sub), prompt_width, generator=generator)  # keeps ADPO's random stream as it always was
    return rows, MaskedStepRows(sub, tok, temperature, RecordedStep(cfg.step_merge))


def chain_rows(sub: RenoiseBatch, cfg: ADPOConfig, tok: CharTokenizer, temperature: float,
               generator: torch.Generator, model: Any = None) -> tuple[Rows, RenoiseStepRows]:
    """A renoising chain's action rows; its temperature schedule travels with the batch, so
    ``temperature`` is not read, and nothing is drawn from ``generator``."""
    return renoise_rows(model, sub, tok)


@register_estimator("adpo")
class ADPO(Estimator):
    reads = ("step_fraction", "step_merge", "is_cap")

    builders = {"masked": step_rows, "renoise": chain_rows}  # batch kind -> its rows
