"""Every estimator on a model small enough to compute by hand: two tokens, a logit table.

The model: completion tokens come from {a, b}; every other token has logit -1e9 (probability 0),
b has logit 0, and a at position i has logit theta_i + phi * (masked positions in the row). So
p(a at i) = sigmoid(theta_i + phi * M), the number a hand computation needs. Float64 throughout.

Per estimator: what it scores checked against values written out with ``math``, and the gradient
the engine produces (algo/update.py, one SGD step at lr 0) against central finite differences of
the estimator's objective (its scorer and loss with the proximal policy frozen at the start).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_estimators import estimator_rows
from torch import nn

from miles_core.algo.advantages import group_advantages, wd1_weights
from miles_core.algo.estimators.ebpo import BlockELBORows, block_noise
from miles_core.algo.estimators.espo import SequenceELBORows, stratified_masks
from miles_core.algo.estimators.spg import SandwichRows, block_masks
from miles_core.algo.loss import SequenceRatioLoss, TokenRatioLoss, WeightedLikelihoodLoss
from miles_core.algo.update import update_policy
from tests.helpers.update_cfg import update_and_own
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

TOK = CharTokenizer()
A, B = TOK.encode("1")[0], TOK.encode("2")[0]
THETA, PHI = [0.3, -0.4, 0.8], 0.25


class TwoToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(THETA, dtype=torch.float64))
        self.phi = nn.Parameter(torch.tensor(PHI, dtype=torch.float64))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n_masked = (ids == TOK.mask_id).sum(1, keepdim=True).double()                   # [B, 1]
        logits = torch.full((*ids.shape, TOK.vocab_size), -1e9, dtype=torch.float64)
        logits[..., B] = 0.0
        logits[..., A] = self.theta[None, : ids.shape[1]] + self.phi * n_masked
        return logits


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def log_p(token: int, pos: int, n_masked: int) -> float:
    """log p(token at absolute position pos) in a row with n_masked masked positions."""
    pa = sig(THETA[pos] + PHI * n_masked)
    return math.log(pa if token == A else 1 - pa)


def batch() -> TrajectoryBatch:
    """One group of two: prompt [a], completions [a, b] (committed at steps 0, 1) and [b, b] (1, 0)."""
    tb = TrajectoryBatch(prompt_ids=[[A], [A]], completion_ids=torch.tensor([[A, B], [B, B]]),
                         step_map=torch.tensor([[0, 1], [1, 0]]), logp=torch.tensor([[-0.5, -0.7], [-0.6, -0.8]]),
                         nfe=torch.tensor([2, 2]), group_id=torch.tensor([0, 0]), policy_version=torch.tensor([0, 0]))
    tb.reward = torch.tensor([1.0, 0.0])
    tb.advantage = group_advantages(tb.reward, tb.group_id)                             # +0.5, -0.5
    return tb


def test_the_model_is_the_hand_formula() -> None:
    ids = torch.tensor([[A, TOK.mask_id, B]])
    lp = torch.log_softmax(TwoToken()(ids, torch.ones_like(ids, dtype=torch.bool)), -1)[0].detach()
    assert math.isclose(float(lp[1, A]), log_p(A, 1, 1), rel_tol=1e-12)
    assert math.isclose(float(lp[2, B]), log_p(B, 2, 1), rel_tol=1e-12)


def test_adpo_scores_each_recorded_step_at_its_state() -> None:
    """Row (b, k) sees the state before step k: trajectory 0 step 0 sees [a, M, M], step 1 [a, a, M]."""
    tb, (cfg, own) = batch(), update_and_own("adpo", step_fraction=1.0)  # every step, each exact
    rows, scorer = estimator_rows(tb, cfg, own, TOK, 1.0, torch.Generator().manual_seed(0))
    logp, _, commit = scorer.score(TwoToken(), rows.traj, rows.step)
    logp = logp.detach()
    got = {(int(b), int(k)): float(logp[r][commit[r]].sum()) for r, (b, k) in enumerate(zip(rows.traj, rows.step))}
    assert got[(0, 0)] == pytest.approx(log_p(A, 1, 2)) and got[(0, 1)] == pytest.approx(log_p(B, 2, 1))
    assert got[(1, 0)] == pytest.approx(log_p(B, 2, 2)) and got[(1, 1)] == pytest.approx(log_p(B, 1, 1))
    # the loss at the update's first step (ratio 1): -sum A * min(pi / mu, C) / (B L), by hand
    iw = lambda lp, mu: min(math.exp(lp - mu), 2.0)  # noqa: E731
    hand = -(0.5 * (iw(log_p(A, 1, 2), -0.5) + iw(log_p(B, 2, 1), -0.7))
             - 0.5 * (iw(log_p(B, 1, 1), -0.6) + iw(log_p(B, 2, 2), -0.8))) / 4
    behav = scorer.behaviour(rows.traj, rows.step)
    out = TokenRatioLoss()(logp, logp.detach(), behav, tb.advantage[rows.traj].double(), commit, rows.weight.double(), 4.0)
    assert float(out.loss) == pytest.approx(hand, rel=1e-6)


def test_spg_bounds_by_hand() -> None:
    """Two copies of each completion (J = 2): trajectory 0 (A > 0) gets the ELBO, trajectory 1
    (A <= 0) the mix w EUBO + (1 - w) ELBO, beta = 1.5, w = 0.5; prompt never masked here."""
    tb = batch()
    copies = torch.tensor([[[True, False], [False, True]], [[True, True], [False, True]]])  # [J, B, L]
    scorer = SandwichRows(tb, TOK, 1.0, copies[None], None, beta=1.5, mix=0.5, advantage=tb.advantage)
    with torch.no_grad():
        s, _, scored = scorer.score(TwoToken(), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long))
    # trajectory 0: copy 1 masks position 0 (t = 1/2, 1 masked), copy 2 both (t = 1, 2 masked)
    elbo0 = [0.5 * (log_p(A, 1, 1) / 0.5 + log_p(A, 1, 2) / 1.0), 0.5 * (log_p(B, 2, 2) / 1.0)]
    assert s[0].tolist() == pytest.approx(elbo0) and scored[0].tolist() == [True, True]
    # trajectory 1: both copies mask only position 1 (t = 1/2): K = {1}
    lp = log_p(B, 2, 1)
    elbo1 = 0.5 * (lp / 0.5 + lp / 0.5)
    eubo1 = (2 / 1) / 1.5 * math.log(0.5 * (math.exp(1.5 * lp) / 0.5 + math.exp(1.5 * lp) / 0.5))
    assert scored[1].tolist() == [False, True]
    assert float(s[1, 1]) == pytest.approx(0.5 * eubo1 + 0.5 * elbo1) and float(s[1, 0]) == 0.0
    assert eubo1 >= elbo1  # the sandwich: the upper bound sits above the lower one


def test_espo_elbo_by_hand_and_its_sequence_ratio() -> None:
    """One coupled pair: trajectory 0 masks x = 1 token (t = 1/3 with L = 2), its complement the
    other; trajectory 1 masks none (x = 0) and its complement both (weight (L+1)/L)."""
    tb = batch()
    masks = torch.tensor([[[True, False], [False, False]]])                             # [n, B, L]
    scorer = SequenceELBORows(tb, TOK, 1.0, masks[None], t=torch.tensor([[[1 / 3, 0.0]]]))
    with torch.no_grad():
        s, _, commit = scorer.score(TwoToken(), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long))
    assert commit.all()
    elbo0 = 0.5 * (log_p(A, 1, 1) * 3) + 0.5 * (log_p(B, 2, 1) * 3)                    # 1/t and 1/((L - x)/(L + 1))
    elbo1 = 0.5 * (log_p(B, 1, 2) * 1.5 + log_p(B, 2, 2) * 1.5)
    assert float(s[0].sum()) == pytest.approx(elbo0) and float(s[1].sum()) == pytest.approx(elbo1)
    # the sequence loss against a proximal ELBO 0.2 nats lower (rho = e^0.1 > 1 + eps for A > 0: clipped)
    prox = s.detach() - 0.1
    out = SequenceRatioLoss(clip_eps=0.05)(s, prox, prox, torch.tensor([0.5, -0.5], dtype=torch.float64),
                                           commit, torch.ones(2, dtype=torch.float64), 4.0)
    rho = math.exp(0.2 / 2)
    hand = (-(min(rho * 0.5, 1.05 * 0.5)) * 2 - (min(rho * -0.5, 1.05 * -0.5)) * 2) / 4
    assert float(out.loss) == pytest.approx(hand, rel=1e-5) and out.stats["clip_frac"] == pytest.approx(0.5)


def test_ebpo_block_elbo_by_hand_and_its_unnormalised_sequence_ratio() -> None:
    """EBPO, N = 1. One block (K = 1, L = 2): trajectory 0 masks position 1 only (p = 1/2),
    trajectory 1 both (p = 1). Two blocks of one token (K = 2): block 0 is scored with block 1
    masked (2 masked), block 1 with block 0 clean (1 masked); p = 1 for a one-token block."""
    tb = batch()
    one = torch.tensor([[[[False, True]], [[True, True]]]])                             # [N, B, K, L]
    scorer = BlockELBORows(tb, TOK, 1.0, one[None], frac=torch.tensor([[[[0.5], [1.0]]]]), block=2)
    with torch.no_grad():
        s, _, commit = scorer.score(TwoToken(), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long))
    assert commit.all()
    assert s[0].tolist() == pytest.approx([0.0, log_p(B, 2, 1) / 0.5])
    assert s[1].tolist() == pytest.approx([log_p(B, 1, 2), log_p(B, 2, 2)])
    two = torch.tensor([[[[True, False], [False, True]]] * 2])                          # every block's one token
    scorer = BlockELBORows(tb, TOK, 1.0, two[None], frac=torch.ones(1, 1, 2, 2), block=1)
    with torch.no_grad():
        s, _, _ = scorer.score(TwoToken(), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long))
    assert s[0].tolist() == pytest.approx([log_p(A, 1, 2), log_p(B, 2, 1)])
    assert s[1].tolist() == pytest.approx([log_p(B, 1, 2), log_p(B, 2, 1)])
    # the sequence ratio is exp of the summed difference, not divided by L (LLaDA2.1 Eq. 5)
    # row 0: 0.3 nats above prox (rho = e^0.3 > 1 + eps, A > 0: clipped); row 1: 0.1 (inside)
    prox = s.detach() - torch.tensor([[0.15], [0.05]], dtype=s.dtype)
    out = SequenceRatioLoss(clip_eps=0.2, per_token=False)(s, prox, prox, torch.tensor([0.5, -0.25], dtype=torch.float64),
                                                           torch.ones_like(s, dtype=torch.bool),
                                                           torch.ones(2, dtype=torch.float64), 4.0)
    hand = (-min(math.exp(0.3) * 0.5, 1.2 * 0.5) * 2 - min(math.exp(0.1) * -0.25, math.exp(0.1) * -0.25) * 2) / 4
    assert float(out.loss) == pytest.approx(hand, rel=1e-6) and out.stats["clip_frac"] == pytest.approx(0.5)
    per_token = SequenceRatioLoss(clip_eps=0.2)(s, prox, prox, torch.tensor([0.5, -0.25], dtype=torch.float64),
                                                torch.ones_like(s, dtype=torch.bool), torch.ones(2, dtype=torch.float64), 4.0)
    assert per_token.stats["clip_frac"] == 0.0  # ESPO's e^(0.3 / 2) is inside the clip: the / L is what differs


def test_block_noise_stratifies_each_copy_over_its_blocks() -> None:
    masks, frac = block_noise(torch.Generator().manual_seed(0), (500,), 10, 4)        # blocks [0,4) [4,8) [8,10)
    assert masks.shape == (500, 3, 10) and frac.shape == (500, 3)
    size = torch.tensor([4, 4, 2])
    inside = torch.zeros(3, 10, dtype=torch.bool)
    for k, (a, b) in enumerate([(0, 4), (4, 8), (8, 10)]):
        inside[k, a:b] = True
    assert not (masks & ~inside).any()                                                  # copy k masks only block k
    counts = masks.sum(-1)
    assert torch.equal(frac, counts / size) and (counts >= 1).all() and (counts <= size).all()
    # one offset u per copy set: block k's noise t = (u + k/3) mod 1, so count_k = floor(t_k L_k) + 1
    u = torch.rand((500, 1), generator=torch.Generator().manual_seed(0))
    t = (u + torch.arange(3) / 3) % 1.0
    assert torch.equal(counts, torch.minimum((t * size).floor().long() + 1, size))


def test_block_masks_follow_spg_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    m = block_masks(gen, (2000,), 10, 4)                                                # blocks [0,4) [4,8) [8,10)
    seen = set()
    for row in m.tolist():
        first = row.index(True)
        blk = first // 4
        start, end = 4 * blk, min(4 * blk + 4, 10)
        assert not any(row[:start]) and all(row[end:])                                  # clean before, masked after
        assert 1 <= sum(row[start:end]) <= end - start
        seen.add((blk, sum(row[start:end])))
    assert seen == {(0, c) for c in range(1, 5)} | {(1, c) for c in range(1, 5)} | {(2, 1), (2, 2)}


def test_stratified_masks_space_the_counts_evenly() -> None:
    masks, t = stratified_masks(torch.Generator().manual_seed(0), 3, 2, 4, 7)        # L = 7, 4 trajectories
    counts = masks.sum(-1)                                                              # [E, n, B]
    assert torch.equal(counts.double(), torch.round(t * 8).double())
    for c in counts.view(-1, 4).tolist():  # offsets k, k+2, k+4, k+6 mod 8: distinct, every other count
        assert len(set(c)) == 4 and len({(x - c[0]) % 2 for x in c}) == 1


ESTIMATORS = ["adpo", "meanfield", "coupled", "wd1", "spg", "espo", "ebpo"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_engine_gradient_matches_finite_differences_of_the_objective(estimator: str) -> None:
    cfg, own = update_and_own(estimator, draws=2, max_grad_norm=1e9, where_declared={"prompt_mask_prob": 0.5})
    tb = batch()
    model = TwoToken()
    update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), tb, cfg, TOK, 1.0, torch.Generator().manual_seed(7),
                  own=own)
    engine = torch.cat([model.theta.grad, model.phi.grad[None]])

    rows, scorer = estimator_rows(tb, cfg, own, TOK, 1.0, torch.Generator().manual_seed(7))  # the same draws
    adv = tb.advantage.double()
    if estimator == "wd1":
        adv = wd1_weights(adv, tb.group_id)
    loss_fn = SequenceRatioLoss(cfg.clip_eps, per_token=estimator == "espo") if estimator in ("espo", "ebpo") else \
        (WeightedLikelihoodLoss if estimator in ("wd1", "spg") else TokenRatioLoss)(cfg.clip_eps, cfg.is_cap)
    with torch.no_grad():
        prox = scorer.score(model, rows.traj, rows.step)[0]

    def objective() -> float:
        with torch.no_grad():
            logp, _, commit = scorer.score(model, rows.traj, rows.step)
            behav = scorer.behaviour(rows.traj, rows.step)
            mu = prox if behav is None else torch.where(behav.isnan(), prox, behav)  # NaN: a run's later steps
            return float(loss_fn(logp, prox, mu, adv[rows.traj], commit,
                                 rows.weight.double(), 4.0).loss)

    eps, fd = 1e-3, []  # the step function computes in float32 (tempered_logits): a float32-sized step
    for p, i in [(model.theta, 0), (model.theta, 1), (model.theta, 2), (model.phi, None)]:
        with torch.no_grad():
            view = p if i is None else p[i]
            view += eps
            up = objective()
            view -= 2 * eps
            down = objective()
            view += eps
        fd.append((up - down) / (2 * eps))
    assert engine.abs().sum() > 0
    torch.testing.assert_close(engine, torch.tensor(fd, dtype=torch.float64), rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("estimator", ["spg", "espo", "ebpo"])
def test_memory_budget_chunks_do_not_change_the_gradient(estimator: str) -> None:
    """``update.chunk_tokens``: a row's cost counts all its copies' forwards (ESPO's pairs twice); a
    budget of one position puts every row in its own chunk, and the gradient adds up the same."""
    grads = []
    for budget in (0, 1):
        model = TwoToken()
        cfg, own = update_and_own(estimator, draws=2, max_grad_norm=1e9, chunk_tokens=budget)
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch(), cfg, TOK, 1.0,
                      torch.Generator().manual_seed(3), own=own)
        grads.append(torch.cat([model.theta.grad, model.phi.grad[None]]))
    torch.testing.assert_close(grads[0], grads[1])
    rows, scorer = estimator_rows(batch(), *update_and_own(estimator, draws=2), TOK, 1.0,
                                  torch.Generator().manual_seed(3))
    per_forward = 3 + 1.0 * 2 / 2  # prompt 1 + completion 2 positions, half the completion's logits
    assert scorer.row_cost(rows.traj, rows.step, 1.0).tolist() == [per_forward * (4 if estimator == "espo" else 2)] * 2
