"""``estimators.adpo.step_sampling = uncertainty``: steps drawn by the behaviour policy's doubt, reweighted.

The claim is unbiasedness: over the draws, the engine's gradient has the expectation of the
gradient with every recorded step scored at weight 1. Checked by brute force on a model small
enough to enumerate every subset of steps: each subset's gradient through the real engine
(algo/update.py), weighted by the probability the draw gives it, summed.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from miles_core.algo.advantages import group_advantages
from miles_core.algo.rows import MaskedStepRows, RecordedStep, Rows
from miles_core.algo.step_choice import inclusion_probs, step_uncertainty, uncertainty_rows
from miles_core.algo.update import UpdateRows, update_policy, as_draws, update_on_rows
from miles_core.config import AdpoSettings, ConfigError, UpdateConfig, load_recipe
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

TOK = CharTokenizer()
A, B = TOK.encode("1")[0], TOK.encode("2")[0]


class TwoToken(nn.Module):
    """p(a at position i) = sigmoid(theta_i + phi * masked positions); every other token but b is
    impossible. Random parameters: nothing symmetric for a wrong weight to hide behind."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.theta = nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))
        self.phi = nn.Parameter(torch.randn((), generator=g, dtype=torch.float64) * 0.5)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n_masked = (ids == TOK.mask_id).sum(1, keepdim=True).double()
        logits = torch.full((*ids.shape, TOK.vocab_size), -1e9, dtype=torch.float64)
        logits[..., B] = 0.0
        logits[..., A] = self.theta[None, : ids.shape[1]] + self.phi * n_masked
        return logits


def batch() -> TrajectoryBatch:
    """Two trajectories of three steps (one token a step), recorded mu from near-certain to a coin flip."""
    tb = TrajectoryBatch(prompt_ids=[[A], [B]], completion_ids=torch.tensor([[A, B, A], [B, B, A]]),
                         step_map=torch.tensor([[0, 2, 1], [1, 0, 2]]),
                         logp=torch.tensor([[-0.01, -0.7, -0.3], [-1.2, -0.002, -0.5]]),
                         nfe=torch.tensor([3, 3]), group_id=torch.tensor([0, 0]), policy_version=torch.tensor([0, 0]))
    tb.reward = torch.tensor([1.0, 0.0])
    tb.advantage = group_advantages(tb.reward, tb.group_id)
    return tb


def grad_of(rows: Rows, tb: TrajectoryBatch, cfg: UpdateConfig, seed: int) -> torch.Tensor:
    """The engine's gradient (SGD at lr 0, so nothing moves) of the ADPO loss over ``rows``."""
    model = TwoToken(seed)
    scorer = MaskedStepRows(tb, TOK, 1.0, RecordedStep(None))
    u = UpdateRows(scorer, rows, tb.advantage.double(), 6.0, as_draws(torch.Generator().manual_seed(0), len(tb)))
    update_on_rows(model, torch.optim.SGD(model.parameters(), lr=0.0), u, cfg)
    return torch.cat([model.theta.grad, model.phi.grad[None]])


def test_uncertainty_is_the_sum_of_one_minus_mu_over_each_steps_tokens() -> None:
    u = step_uncertainty(batch())
    want = [[1 - math.exp(-0.01), 1 - math.exp(-0.3), 1 - math.exp(-0.7)],
            [1 - math.exp(-0.002), 1 - math.exp(-1.2), 1 - math.exp(-0.5)]]
    torch.testing.assert_close(u, torch.tensor(want, dtype=torch.float64))


def test_inclusion_probabilities_spend_the_budget_in_proportion_with_a_floor() -> None:
    u = torch.tensor([[0.01, 0.3, 0.6, 0.0], [0.5, 0.5, 0.5, 0.5], [1e-4, 1e-4, 0.9, 0.8]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False], [True] * 4, [True] * 4])
    pi = inclusion_probs(u, valid, torch.tensor([1.2, 2.0, 1.0], dtype=torch.float64), 0.05)
    torch.testing.assert_close(pi.sum(1), torch.tensor([1.2, 2.0, 1.0], dtype=torch.float64))
    assert pi[0, 3] == 0 and (pi[valid] >= 0.05 - 1e-12).all() and (pi <= 1).all()
    torch.testing.assert_close(pi[0, 2] / pi[0, 1], torch.tensor(2.0, dtype=torch.float64))   # above the floor: ~ u
    assert pi[0, 0] == pytest.approx(0.05) and torch.allclose(pi[1], torch.full((4,), 0.5, dtype=torch.float64))
    # a budget the floor already exceeds: every step at the floor; one beyond reach: every step at 1
    low = inclusion_probs(u[1:2], valid[1:2], torch.tensor([0.1], dtype=torch.float64), 0.05)
    high = inclusion_probs(u[1:2], valid[1:2], torch.tensor([9.0], dtype=torch.float64), 0.05)
    assert torch.allclose(low, torch.full((1, 4), 0.05, dtype=torch.float64)) and torch.equal(high, torch.ones(1, 4, dtype=torch.float64))


def test_the_draw_includes_each_step_with_its_probability_and_weighs_it_back() -> None:
    tb = batch()
    valid = torch.ones(2, 3, dtype=torch.bool)
    pi = inclusion_probs(step_uncertainty(tb), valid, torch.tensor([1.5, 1.5], dtype=torch.float64), 0.05)
    hits = torch.zeros(2, 3)
    g, n = torch.Generator().manual_seed(1), 3000
    for _ in range(n):
        r = uncertainty_rows(tb, 0.5, 0.05, as_draws(g, len(tb)))
        hits[r.traj, r.step] += 1
        torch.testing.assert_close(r.weight, (1 / pi[r.traj, r.step]).float())   # E[w 1{drawn}] = 1 per step
    torch.testing.assert_close(hits / n, pi.float(), atol=0.035, rtol=0)        # 4 standard errors at most


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reweighted_gradient_is_unbiased_for_the_full_one_by_enumeration(seed: int) -> None:
    tb = batch()
    cfg, own = UpdateConfig(max_grad_norm=1e9), AdpoSettings(step_cover=False, step_sampling="uncertainty", step_fraction=0.4)
    steps = [(b, k) for b in range(2) for k in range(3)]
    full = grad_of(Rows(torch.tensor([b for b, _ in steps]), torch.tensor([k for _, k in steps]),
                        torch.ones(6)), tb, cfg, seed)
    pi = inclusion_probs(step_uncertainty(tb), torch.ones(2, 3, dtype=torch.bool),
                         own.step_fraction * tb.num_steps.double(), own.step_floor)
    assert len(set(pi.flatten().tolist())) > 3          # unequal probabilities: a wrong weight would show
    expected, flat = torch.zeros_like(full), torch.zeros_like(full)
    for subset in itertools.product([False, True], repeat=6):
        chosen = [s for s, on in zip(steps, subset) if on]
        prob = math.prod(float(pi[s]) if on else 1 - float(pi[s]) for s, on in zip(steps, subset))
        if not chosen:
            continue
        traj, step = torch.tensor([b for b, _ in chosen]), torch.tensor([k for _, k in chosen])
        expected += prob * grad_of(Rows(traj, step, torch.tensor([1 / float(pi[s]) for s in chosen])), tb, cfg, seed)
        # the same draws weighted by the expected share of steps kept, as if uniform: biased
        flat += prob * grad_of(Rows(traj, step, torch.full((len(chosen),), 6 / float(pi.sum()))), tb, cfg, seed)
    assert full.abs().sum() > 0
    torch.testing.assert_close(expected, full, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(flat, full, rtol=1e-2)    # the check can fail: the weights are what makes it hold


def test_the_estimator_builds_these_rows_and_the_engine_runs_them() -> None:
    tb = batch()
    cfg, own = UpdateConfig(max_grad_norm=1e9), AdpoSettings(step_cover=False, step_sampling="uncertainty", step_fraction=0.5)
    model = TwoToken(0)
    stats = update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), tb, cfg, TOK, 1.0,
                          torch.Generator().manual_seed(5), own=own)
    want = uncertainty_rows(tb, 0.5, own.step_floor, as_draws(torch.Generator().manual_seed(5), len(tb)))
    assert stats["rows"] == want.traj.numel()


def test_uncertainty_sampling_is_refused_with_covering_or_merged_rows() -> None:
    with pytest.raises(ConfigError, match="estimators.adpo.step_sampling"):
        load_recipe("arith", ["estimators.adpo.step_sampling=uncertainty"])            # step_cover is true by default
    with pytest.raises(ConfigError, match="estimators.adpo.step_sampling"):
        load_recipe("arith", ["estimators.adpo.step_sampling=uncertainty", "estimators.adpo.step_cover=false", "estimators.adpo.step_merge=2"])
    cfg = load_recipe("arith", ["estimators.adpo.step_sampling=uncertainty", "estimators.adpo.step_cover=false"])
    assert cfg.estimators.adpo.step_sampling == "uncertainty"
