"""Math-first unit tests for the discrete core: log-probs, trajectories, ADPO loss, advantages."""

from __future__ import annotations

import math

import pytest
import torch

from miles_core.algo.update import as_draws

from miles_core.algo.advantages import group_advantages, zero_variance_groups
from miles_core.algo.loss import TokenRatioLoss
from miles_core.algo.schedule import lr_factor
from miles_core.algo.rows import score_rows
from miles_core.algo.step_choice import build_rows
from miles_core.config import SamplerConfig
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.samplers.sampler import nsd_commit, sample, static_counts, topk_commit
from miles_core.samplers.step import rebuild_state, step_from_logits
from miles_core.tokenizer import CharTokenizer

TOK = CharTokenizer()


def tiny_model(seed: int = 0) -> TinyDenoiser:
    torch.manual_seed(seed)
    m = TinyDenoiser(TinyConfig(TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48))
    for p in m.parameters():  # larger weights so distributions are far from uniform
        p.data.mul_(20)
    return m.eval()


PROMPTS = [TOK.encode(p) for p in ["3+4*2", "12-5", "7*8-1", "9"]]


class Recorder(torch.nn.Module):
    """Wraps a denoiser and keeps every input it sees (to check rebuilt states)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.inputs = inner, []

    def forward(self, x, attn=None):
        self.inputs.append(x.clone())
        return self.inner(x, attn)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("block", [0, 4])
def test_step_map_rebuilds_every_state_and_scoring_reproduces_logp(remasking, block):
    model = Recorder(tiny_model())
    cfg = SamplerConfig(steps=6, block_size=block, temperature=1.0, remasking=remasking)
    batch = sample(model, TOK, PROMPTS, cfg, 12, torch.Generator().manual_seed(3))
    width = max(len(p) for p in PROMPTS)
    assert (batch.step_map >= 0).all() and (batch.nfe == 6).all()
    assert torch.isfinite(batch.logp).all()
    assert not any(t in TOK.forbidden_ids for t in batch.completion_ids.flatten().tolist())
    for k, x in enumerate(model.inputs):  # static: every row is active at every step
        rebuilt = rebuild_state(batch.completion_ids, batch.step_map, torch.full((4,), k), TOK.mask_id)
        assert torch.equal(x[:, width:], rebuilt)
    # scoring each recorded (b, k) row with the learner's path reproduces the stored log-prob exactly
    rows = build_rows(batch, 1.0, as_draws(torch.Generator(), len(batch)))
    logp, _, commit = score_rows(model.inner, batch, rows.traj, rows.step, TOK, 1.0)
    stored = batch.logp[rows.traj]
    assert torch.equal(logp[commit], stored[commit])
    # every completion position is committed exactly once
    assert commit.sum() == batch.completion_ids.numel()


def test_scored_token_logprobs_match_brute_force_softmax():
    logits = torch.randn(2, 3, TOK.vocab_size)
    tokens = torch.randint(4, TOK.vocab_size, (2, 3))
    got = step_from_logits(logits, temperature=0.7, forbidden=TOK.forbidden_ids, tokens=tokens, entropy=False).logp
    for i in range(2):
        for j in range(3):
            z = logits[i, j] / 0.7
            allowed = [v for v in range(TOK.vocab_size) if v not in TOK.forbidden_ids]
            denom = math.log(sum(math.exp(float(z[v])) for v in allowed))
            assert got[i, j].item() == pytest.approx(float(z[tokens[i, j]]) - denom, abs=1e-5)


def test_sampling_is_an_exact_draw_from_the_tempered_policy():
    """Gumbel-max frequencies match softmax(logits / T) (chi-square style tolerance)."""
    from miles_core.samplers.step import denoise_step

    class Fixed(torch.nn.Module):
        def forward(self, x, attn=None):
            out = torch.full((x.shape[0], x.shape[1], TOK.vocab_size), -50.0)
            out[..., 10], out[..., 11], out[..., 12] = 1.0, 0.0, -1.0
            return out
    x = torch.full((20000, 2), TOK.mask_id)
    out = denoise_step(Fixed(), x, torch.ones_like(x, dtype=torch.bool), 1, temperature=2.0,
                       forbidden=TOK.forbidden_ids, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out.tokens[:, 0], minlength=TOK.vocab_size).float() / 20000
    p = torch.softmax(torch.tensor([0.5, 0.0, -0.5]), 0)
    assert torch.allclose(freq[10:13], p, atol=0.015)


def test_static_counts_and_topk_commit():
    assert static_counts(10, 4) == [3, 3, 2, 2] and sum(static_counts(36, 18)) == 36
    with pytest.raises(ValueError):
        static_counts(4, 5)
    score = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.8, 0.1]])
    elig = torch.tensor([[True, True, False, True], [True, True, True, True]])
    c = topk_commit(score, elig, torch.tensor([2, 1]))
    assert c.tolist() == [[False, True, False, True], [False, False, True, False]]


def test_nsd_commit_threshold_cap_and_floor():
    conf = torch.tensor([[0.99, 0.95, 0.5, 0.97, 0.2], [0.1, 0.2, 0.3, 0.4, 0.5]])
    elig = torch.ones_like(conf, dtype=torch.bool)
    c = nsd_commit(conf, elig, 0.9, 1, 2)
    assert c[0].tolist() == [True, False, False, True, False]   # 3 confident, capped at 2 (highest)
    assert c[1].tolist() == [False, False, False, False, True]  # none confident -> at least 1


def test_clipped_surrogate_and_truncated_weight_worked_example():
    # one row, three committed tokens, A = +1 ; eps = 0.2 ; C = 2
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).requires_grad_(True)
    prox = torch.log(torch.tensor([[0.4, 0.3, 0.25]]))
    behav = torch.log(torch.tensor([[0.1, 0.3, 0.5]]))
    loss_fn = TokenRatioLoss(clip_eps=0.2, is_cap=2.0)
    out = loss_fn(logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([1.0]), 3.0)
    # r = [1.25, 1.0, 0.8]; clip -> [1.2, 1.0, 0.8]; min(rA, clip(r)A) = [1.2, 1.0, 0.8]
    # w = min(prox/behav, 2) = [min(4, 2), 1, 0.5] = [2, 1, 0.5]
    expected = -(2 * 1.2 + 1 * 1.0 + 0.5 * 0.8) / 3.0
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.stats["clip_frac"] == pytest.approx(1 / 3)
    assert out.stats["iw_max"] == pytest.approx(4.0) and out.stats["iw_mean"] == pytest.approx(3.5 / 3)
    out.loss.backward()
    # clipped token (ratio 1.25 > 1.2 with A > 0) gets no gradient; others get -w * r * A / N
    g = logp.grad[0]
    assert g[0].item() == 0.0
    assert g[1].item() == pytest.approx(-1 * 1.0 / 3.0) and g[2].item() == pytest.approx(-0.5 * 0.8 / 3.0)


def test_negative_advantage_clipping_and_kl_k3():
    logp = torch.log(torch.tensor([[0.2]]))
    prox = torch.log(torch.tensor([[0.4]]))
    out = TokenRatioLoss(0.2, 2.0, kl_coef=0.5)(logp, prox, prox, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool),
                                          torch.tensor([2.0]), 1.0, ref_logp=torch.log(torch.tensor([[0.1]])))
    # r = 0.5, A = -1: min(-0.5, -0.8) = -0.8 -> l = 0.8 ; k3 = e^{d} - d - 1 with d = log(0.1/0.2)
    d = math.log(0.5)
    expected = 2.0 * (0.8 + 0.5 * (math.exp(d) - d - 1))
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, float("nan"), 0.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    a = group_advantages(r, g)
    assert a.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    a_std = group_advantages(r, g, std_normalize=True)
    s = math.sqrt((4 * 0.25) / 3)
    assert a_std[0].item() == pytest.approx(0.5 / (s + 1e-6))
    assert zero_variance_groups(r, g).tolist() == [False] * 4 + [True] * 4


def test_step_subsampling_is_unbiased_reweighting():
    model = tiny_model()
    batch = sample(model, TOK, PROMPTS, SamplerConfig(steps=8), 8, torch.Generator().manual_seed(0))
    rows = build_rows(batch, 0.25, as_draws(torch.Generator().manual_seed(1), len(batch)))
    for b in range(4):
        m = rows.traj == b
        assert int(m.sum()) == 2 and torch.allclose(rows.weight[m], torch.tensor(4.0))
        assert len(set(rows.step[m].tolist())) == 2
    # expectation over subsamples of sum_k weight * f(k) equals sum_k f(k)
    f = torch.arange(8.0) ** 2
    est = []
    gen = torch.Generator().manual_seed(2)
    for _ in range(4000):
        rr = build_rows(batch, 0.25, as_draws(gen, len(batch)))
        m = rr.traj == 0
        est.append(float((rr.weight[m] * f[rr.step[m]]).sum()))
    assert sum(est) / len(est) == pytest.approx(float(f.sum()), rel=0.03)


def test_lr_factor_warms_up_then_decays_to_zero_at_the_horizon():
    # warm-up 5 steps: 1/5 .. 5/5; then steps 5..103 decay, reaching 0 at the horizon 104
    const = lr_factor(5, "constant", 104)
    assert [const(s) for s in (0, 1, 4, 5, 103, 1000)] == pytest.approx([0.2, 0.4, 1.0, 1.0, 1.0, 1.0])
    lin = lr_factor(5, "linear", 104)
    assert [lin(s) for s in (0, 4, 5, 54, 103, 104, 500)] == pytest.approx([0.2, 1.0, 0.99, 0.5, 0.01, 0.0, 0.0])
    cos = lr_factor(5, "cosine", 104)
    # frac = (s - 4) / 100: cos at frac 0.01, 0.5, 1 -> 0.5 * (1 + cos(pi * frac))
    assert [cos(s) for s in (0, 5, 54, 104, 500)] == pytest.approx(
        [0.2, 0.5 * (1 + math.cos(math.pi * 0.01)), 0.5, 0.0, 0.0])
