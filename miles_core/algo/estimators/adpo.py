"""``adpo`` (the default): ADPO's rows are the recorded denoising steps themselves. Row (b, k) is
the state before step k, rebuilt from ``step_map``, scoring the tokens committed at k against their
stored behaviour log-probs: the recorded trajectory's own likelihood, with an importance weight
min(pi_prox / mu, ``update.is_cap``) for stale samples.

An update's forwards are ``step_fraction`` = rho times the K_b steps of each trajectory. How
those ceil(rho K_b) rows are spent is ``step_cover``:

* True (the default): they partition all K_b steps into runs of consecutive steps (lengths
  floor/ceil of K_b / m_b, the longer runs at random places), each run scored at its first step's
  state, so every committed token gets a gradient in every update. A run of one step is exact; a
  longer run scores its later tokens at an earlier state than they were sampled from, so its
  ratio is against the proximal policy (TraceRL's shrinkage, Wang et al., 2025, arXiv:2509.06949,
  with the run length chosen from K and rho instead of fixed). Why it is the default: a token
  without a gradient in an update teaches nothing there, whereas the earlier state only blurs its
  context, so at small rho (0.25 in the large recipes) covering leaves no committed token out where
  sampling would skip 3 of 4; at equal forwards on arith the two designs are within noise of each
  other (the measurements: docs/concepts/estimators.md).
* False: a random rho of the steps, each exact, reweighted by K_b / m_b so the objective is
  unbiased for the full one; 1 - rho of the tokens get no gradient in that update.

``step_sampling = uncertainty`` (with ``step_cover`` false) draws each step with probability
rising in how uncertain the behaviour policy was about the tokens it committed there (the sum of
1 - mu), rho K_b rows expected, each reweighted by 1 / its probability so the objective stays the
full one (Horvitz-Thompson); ``step_floor`` is the least probability of any step. NSD's
saving in the update: a step where every committed token was near-certain has a near-zero
gradient, so its forward is better spent on a step with a real choice (algo/step_choice.py).

``step_merge`` = s > 1 fixes the run length at s and scores a random rho of the runs
(reweighted), as TraceRL does; ``step_cover`` is then not read.

The one estimator with rows for a renoising chain (DiffusionGemma, algo/renoise_rows.py): its
steps are recorded actions too, whereas there is no masked state to take an ELBO over.

Its settings are ``estimators.adpo`` (config/estimators.py): ``step_fraction``, ``step_cover``,
``step_merge``, ``step_sampling``, ``step_floor`` and, for renoising chains, ``renoise_output``
(algo/renoise_rows.py); its importance weight is capped at ``update.is_cap``.
"""

from __future__ import annotations

from typing import Any

from miles_core.algo.draws import Draws
from miles_core.algo.estimators import Estimator, register_estimator
from miles_core.algo.renoise_rows import RenoiseStepRows, renoise_rows
from miles_core.algo.rows import MaskedStepRows, RecordedStep, Rows
from miles_core.algo.step_choice import build_rows, uncertainty_rows
from miles_core.config import AdpoSettings
from miles_core.tokenizer import CharTokenizer
from miles_core.types import RenoiseBatch, TrajectoryBatch


def step_rows(sub: TrajectoryBatch, own: AdpoSettings, epochs: int, tok: CharTokenizer, temperature: float,
              draws: Draws, model: Any = None) -> tuple[Rows, MaskedStepRows]:
    """The rows (ceil(rho K_b) per trajectory: runs covering every step, or sampled steps) and their scorer."""
    if own.step_sampling == "uncertainty":
        rows = uncertainty_rows(sub, own.step_fraction, own.step_floor, draws)
    else:
        rows = build_rows(sub, own.step_fraction, draws, own.step_merge, own.step_cover)
    return rows, MaskedStepRows(sub, tok, temperature, RecordedStep(rows.bounds))


def chain_rows(sub: RenoiseBatch, own: AdpoSettings, epochs: int, tok: CharTokenizer, temperature: float,
               draws: Draws, model: Any = None) -> tuple[Rows, RenoiseStepRows]:
    """A renoising chain's action rows; its temperature schedule travels with the batch, so
    ``temperature`` is not read, and nothing is drawn."""
    return renoise_rows(model, sub, tok, own.renoise_output)


@register_estimator("adpo")
class ADPO(Estimator):
    settings = AdpoSettings

    builders = {"masked": step_rows, "renoise": chain_rows}  # batch kind -> its rows
