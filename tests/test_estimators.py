"""Estimators as row builders in the one update engine (algo/update.py): what each row scores,
and the gradient each produces against a brute-force computation of its objective."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_core_train import TOK, base_model, scored_batch

from miles_core.algo.advantages import group_advantages, wd1_weights
from miles_core.algo.estimators import get_estimator
from miles_core.algo.rows import MaskedCopy, row_inputs
from miles_core.algo.update import UpdateRows, update_policy, as_draws, update_on_rows
from miles_core.config import UpdateConfig
from tests.helpers.update_cfg import update_and_own
from miles_core.models.lora import add_lora
from miles_core.samplers.step import denoise_step, left_pad


def lora_model(seed: int = 1):
    model = add_lora(base_model(), r=4, alpha=8)
    with torch.no_grad():  # a non-zero B, so every LoRA tensor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


def estimator_rows(batch, cfg: UpdateConfig, own, tok, temperature: float, gen: torch.Generator):
    """The rows ``cfg.estimator`` builds for ``batch`` and their scorer, draws keyed by position."""
    return get_estimator(cfg.estimator).rows(batch, own, cfg.epochs, tok, temperature, as_draws(gen, len(batch)), None)


def test_coupled_rows_score_every_completion_token_exactly_once_per_pair():
    batch = scored_batch(lora_model())
    cfg, own = update_and_own("coupled", epochs=2)
    rows, scorer = estimator_rows(batch, cfg, own, TOK, 1.0, torch.Generator().manual_seed(0))
    assert rows.traj.tolist() == [b for b in range(len(batch)) for _ in range(2)]
    assert rows.step.tolist() == [0, 1] * len(batch) and torch.equal(rows.weight, torch.ones(2 * len(batch)))
    assert scorer.comp_masks is not None and not torch.equal(scorer.comp_masks[0], scorer.comp_masks[1])  # redrawn
    for epoch in range(2):
        scorer.set_epoch(epoch)
        x, _, width, commit = row_inputs(batch, rows.traj, rows.step, TOK, MaskedCopy(),
                                         comp_mask=scorer.masks(rows.traj, rows.step)[1])
        pair = commit.view(len(batch), 2, -1)
        assert torch.equal(pair.sum(1), torch.ones_like(pair[:, 0], dtype=torch.long))  # once per pair
        state = x[:, width:]
        assert torch.equal(state == TOK.mask_id, commit)  # a row masks exactly what it scores
        assert torch.equal(state[~commit], batch.completion_ids[rows.traj][~commit])  # and keeps the rest


def test_coupled_gradient_matches_a_brute_force_objective():
    """At the first step the ratio is 1, so the clipped objective's gradient is that of
    -sum_b A_b sum_l log p(y_bl | y with M_b (or its complement) masked) / (B * L): built here by
    hand, with two explicit forward passes per trajectory, and compared with the engine's."""
    model = lora_model()
    batch = scored_batch(model)
    batch.reward = torch.arange(len(batch), dtype=torch.float32)  # no A = 0 row: every trajectory kept
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    cfg, own = update_and_own("coupled", max_grad_norm=1e9, row_chunk=5)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(3)
    rows, scorer = estimator_rows(batch, cfg, own, TOK, 1.0, torch.Generator().manual_seed(3))
    update_policy(model, torch.optim.SGD(params, lr=0.0), batch, cfg, TOK, 1.0, gen, own=own)
    engine = [p.grad.detach().clone() for p in params]

    model.zero_grad(set_to_none=True)
    mask = scorer.comp_masks[0, 0]  # the same draw: the generator is consumed in the same order
    prompt, real = left_pad(batch.prompt_ids, TOK.pad_id)
    total = 0.0
    for half in (mask, ~mask):
        state = batch.completion_ids.masked_fill(half, TOK.mask_id)
        x = torch.cat([prompt, state], 1)
        attn = torch.cat([real, torch.ones_like(state, dtype=torch.bool)], 1)
        out = denoise_step(model, x, attn, prompt.shape[1], temperature=1.0, forbidden=TOK.forbidden_ids,
                           tokens=batch.completion_ids)
        total = total + (out.logp * half * batch.advantage[:, None]).sum()
    (-total / (len(batch) * batch.completion_len)).backward()
    brute = [p.grad.detach().clone() for p in params]
    assert sum(float(g.abs().sum()) for g in brute) > 0
    for a, b in zip(engine, brute):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("estimator", ["meanfield", "coupled", "spg", "espo", "ebpo"])
def test_masks_are_redrawn_every_epoch_and_the_proximal_policy_follows(estimator):
    """d1 draws a fresh prompt mask at every inner iteration (DiffuCoder a fresh mask pair, SPG
    fresh copies, ESPO fresh pairs, EBPO fresh noised blocks, as their mask seeds change per iteration);
    the proximal log-probs must be scored with that epoch's mask. With a step too small to move
    the policy, the ratio is then exactly 1 (approx. KL 0) in every epoch; a proximal policy
    scored under another epoch's mask would give a KL far from 0."""
    model = lora_model()
    batch = scored_batch(model)
    cfg, own = update_and_own(estimator, epochs=3, row_chunk=5,
                              **({"prompt_mask_prob": 0.5} if estimator in ("meanfield", "spg") else {}))
    rows, scorer = estimator_rows(batch, cfg, own, TOK, 1.0, torch.Generator().manual_seed(0))
    masks = scorer.prompt_masks if estimator == "meanfield" else scorer.comp_masks
    assert masks is not None and masks.shape[0] == 3 and not torch.equal(masks[0], masks[2])
    params = [p for p in model.parameters() if p.requires_grad]
    stats = update_policy(model, torch.optim.SGD(params, lr=0.0), batch, cfg, TOK, 1.0, torch.Generator().manual_seed(0),
                          own=own)
    assert stats["approx_kl"] < 1e-9 and stats["clip_frac"] == 0.0

    class StaleProx:  # the proximal pass under epoch 0's mask, every update pass under epoch 2's
        width, per_epoch = scorer.width, False

        def score(self, m, traj, step):
            scorer.set_epoch(2 if torch.is_grad_enabled() else 0)
            return scorer.score(m, traj, step)

        def behaviour(self, traj, step):
            return None

    adv = torch.nan_to_num(batch.advantage, nan=0.0)
    # two minibatches: the first takes pi_prox from its own forward, the second from the stale pass
    u = UpdateRows(StaleProx(), rows, adv, float(len(batch) * batch.completion_len),
                   as_draws(torch.Generator().manual_seed(0), len(batch)))
    bad = update_on_rows(model, torch.optim.SGD(params, lr=0.0), u, replace(cfg, num_minibatches=2))
    assert bad["approx_kl"] > 1e-6  # the check above can fail


def test_wd1_weights_by_hand():
    # a group of two with A = +-1: softmax([1, -1]) - softmax([-1, 1]) = +-(e - 1/e) / (e + 1/e) = +-tanh(1)
    w = wd1_weights(torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5]), torch.tensor([0, 0, 1, 1, 1]))
    torch.testing.assert_close(w[:2], torch.tensor([math.tanh(1.0), -math.tanh(1.0)]))
    e = torch.exp(torch.tensor([0.5, 0.0, -0.5]))
    torch.testing.assert_close(w[2:], e / e.sum() - e.flip(0) / e.sum())
    assert abs(float(w[2:].sum())) < 1e-7


def test_wd1_gradient_is_the_weighted_likelihood_and_has_no_ratio():
    """wd1's gradient is that of -sum_b w_b sum_l log p(y_bl | prompt partly masked, completion
    masked) / (B * L), computed here by hand; over several epochs nothing is clipped."""
    model = lora_model()
    batch = scored_batch(model)
    batch.reward = torch.arange(len(batch), dtype=torch.float32)
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    cfg, own = update_and_own("wd1", max_grad_norm=1e9, row_chunk=5, prompt_mask_prob=0.3)
    params = [p for p in model.parameters() if p.requires_grad]
    _, scorer = estimator_rows(batch, cfg, own, TOK, 1.0, torch.Generator().manual_seed(5))
    update_policy(model, torch.optim.SGD(params, lr=0.0), batch, cfg, TOK, 1.0, torch.Generator().manual_seed(5), own=own)
    engine = [p.grad.detach().clone() for p in params]

    model.zero_grad(set_to_none=True)
    prompt, real = left_pad(batch.prompt_ids, TOK.pad_id)
    prompt = prompt.masked_fill(scorer.prompt_masks[0, 0][:, -prompt.shape[1]:] & real, TOK.mask_id)
    state = torch.full_like(batch.completion_ids, TOK.mask_id)
    out = denoise_step(model, torch.cat([prompt, state], 1), torch.cat([real, torch.ones_like(state, dtype=torch.bool)], 1),
                       prompt.shape[1], temperature=1.0, forbidden=TOK.forbidden_ids, tokens=batch.completion_ids)
    w = wd1_weights(batch.advantage, batch.group_id)
    (-(out.logp.sum(1) * w).sum() / (len(batch) * batch.completion_len)).backward()
    for a, b in zip(engine, [p.grad.detach().clone() for p in params]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    stats = update_policy(model, torch.optim.AdamW(params, lr=0.05), batch,
                          UpdateConfig(estimator="wd1", epochs=3, num_minibatches=2, row_chunk=5), TOK, 1.0,
                        torch.Generator().manual_seed(0))
    assert stats["approx_kl"] > 0 and stats["clip_frac"] == 0.0  # the policy moved; wd1 has no ratio to clip


@pytest.mark.parametrize(("estimator", "per_sample"), [("meanfield", 1), ("wd1", 1), ("coupled", 2)])
def test_mask_draws_are_rows_of_weight_one_over_n(estimator, per_sample):
    """``mask_draws=n`` (d1's, wd1's, coupled's): n Monte-Carlo mask draws per trajectory, each its
    own row(s) with weight 1/n, so the objective is the average over draws."""
    batch = scored_batch(lora_model())
    rows1, _ = estimator_rows(batch, *update_and_own(estimator), TOK, 1.0, torch.Generator().manual_seed(0))
    rows, many = estimator_rows(batch, *update_and_own(estimator, mask_draws=3), TOK, 1.0,
                                torch.Generator().manual_seed(0))
    b = len(batch)
    assert rows.traj.numel() == 3 * per_sample * b and torch.allclose(rows.weight, torch.full_like(rows.weight, 1 / 3))
    assert torch.equal(rows1.weight, torch.ones(per_sample * b))
    for traj in range(b):  # each trajectory's rows carry distinct draws
        mine = rows.traj == traj
        pm, cm = many.masks(rows.traj[mine], rows.step[mine])
        m = pm if estimator != "coupled" else cm
        assert len({tuple(r.tolist()) for r in m}) > 1 or not m.any()




def _counted_update(estimator: str, cfg: UpdateConfig, own, reuse: bool, monkeypatch,
                    version: int | None = None) -> tuple[list[torch.Tensor], int, int]:
    """One AdamW update through ``update_policy``: the trained parameters, the rows scored without
    grad (proximal passes; cfg has no KL, so no reference passes) and the rows built."""
    import miles_core.algo.update as U

    model = lora_model()
    batch = scored_batch(model)
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 3
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    no_grad_rows, n_rows = [0], [0]
    real_rows = U.get_estimator(estimator).rows

    def counting_rows(*a, **k):
        r, scorer = real_rows(*a, **k)
        n_rows[0] = r.traj.numel()
        real_score = scorer.score

        def score(m, traj, step):
            no_grad_rows[0] += 0 if torch.is_grad_enabled() else traj.numel()
            return real_score(m, traj, step)
        scorer.score = score
        return r, scorer
    monkeypatch.setattr(U.get_estimator(estimator), "rows", counting_rows)
    monkeypatch.setattr(U, "deterministic_forward", lambda m: reuse)
    params = [p for p in model.parameters() if p.requires_grad]
    U.update_policy(model, torch.optim.AdamW(params, lr=0.05), batch, cfg, TOK, 1.0, torch.Generator().manual_seed(3),
                    version=version, own=own)
    monkeypatch.undo()
    start = [p.detach() for p in lora_model().parameters() if p.requires_grad]
    assert sum(float((a - b.detach()).abs().sum()) for a, b in zip(params, start)) > 0  # the steps moved the policy
    return [p.detach().clone() for p in params], no_grad_rows[0], n_rows[0]


@pytest.mark.parametrize("estimator", ["adpo", "ebpo"])
def test_the_first_minibatch_takes_the_proximal_policy_from_its_own_forward(estimator, monkeypatch):
    """pi_prox is the policy before the update, which is what the first minibatch's forward runs
    on: its rows skip the separate no-grad pass, and two epochs of AdamW steps land where scoring
    every row's pi_prox separately lands. With dropout active, every row gets its own pass."""
    cfg, own = update_and_own(estimator, epochs=2, num_minibatches=2, row_chunk=3,
                              **({"timesteps": 2, "mask_block": 4} if estimator == "ebpo" else {}))
    reused, n_reused, n_rows = _counted_update(estimator, cfg, own, True, monkeypatch)
    separate, n_separate, _ = _counted_update(estimator, cfg, own, False, monkeypatch)
    per_epoch = estimator == "ebpo"  # fresh masks each epoch: pi_prox scored per epoch
    assert n_separate == n_rows * (2 if per_epoch else 1)
    assert n_reused == n_separate - -(-n_rows // 2)  # the first minibatch's rows: no separate pass
    # Equal up to float32 summation order: the reused forward runs on a minibatch, the separate
    # pass on chunks of row_chunk, and Adam turns a rounding-level gradient difference on a
    # near-zero gradient into up to ~1e-5 here (1.4e-5 on one 2-core machine, under 1e-6 on
    # another); a wrong pi_prox moves the second minibatch's ratios and the weights by ~lr = 0.05.
    for a, b in zip(reused, separate):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cover", [False, True])
def test_trajectories_the_update_sampled_take_the_proximal_policy_from_their_recorded_mu(cover, monkeypatch):
    """A batch sampled by the weights the update starts from (its policy_version is the update's
    version): pi_prox = mu, recorded at sampling, for every exact row, so no proximal pass runs for
    them; a covering run of two steps has no mu for its later tokens and keeps its pass. The
    update lands where scoring pi_prox lands; a stale batch (another version) gets every pass."""
    cfg, own = update_and_own("adpo", epochs=2, num_minibatches=2, row_chunk=3, step_fraction=0.5, step_cover=cover)
    by_mu, n_mu, n_rows = _counted_update("adpo", cfg, own, False, monkeypatch, version=0)
    separate, n_separate, _ = _counted_update("adpo", cfg, own, False, monkeypatch, version=None)
    _, n_stale, _ = _counted_update("adpo", cfg, own, False, monkeypatch, version=1)
    assert n_separate == n_stale == n_rows
    assert n_mu == (n_rows if cover else 0)  # at K = 4 and rho 0.5, covering rows are all runs of two
    for a, b in zip(by_mu, separate):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_dropout_makes_every_row_score_its_own_proximal_policy():
    from miles_core.algo.update import deterministic_forward

    assert deterministic_forward(lora_model())
    assert not deterministic_forward(add_lora(base_model(), r=4, alpha=8, dropout=0.1))
