"""Continuous diffusion policies: the step function, the ODE solver, ADPO on continuous
trajectories, the task split and the Arrow layout. Tiny models, one thread, seconds."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from miles_core.config import AdpoSettings, UpdateConfig
from miles_core.continuous.policy import LORA_TARGETS, ContinuousDenoiser, DenoiserConfig, encode_prompts
from miles_core.continuous.sde import NoiseSchedule, ddim_step, gaussian_log_prob, sample_ode, sample_sde
from miles_core.continuous.storage import ContinuousSchemaError, continuous_store, from_table, to_table
from miles_core.continuous.task import ConstraintTask, is_test_prompt
from miles_core.continuous.train import update_policy, build_step_rows, rollout, score_steps
from miles_core.models.lora import add_lora, trainable_parameters
from miles_core.storage import BatchExistsError, BatchNotFoundError, CorruptBatchError
from miles_core.tokenizer import CharTokenizer

torch.set_num_threads(1)
SCHED = NoiseSchedule()


def tiny_policy(seed: int = 0) -> ContinuousDenoiser:
    """A small denoiser with a non-zero head, so eps (and every step's mean) depends on the weights."""
    torch.manual_seed(seed)
    m = ContinuousDenoiser(DenoiserConfig(latent_dim=4, vocab_size=CharTokenizer().vocab_size, hidden=32))
    nn.init.normal_(m.head.weight, std=0.3)
    nn.init.normal_(m.film.weight, std=0.1)
    return m


def recorded(model, n_prompts: int = 3, group: int = 4, steps: int = 6, seed: int = 0):
    task, tok = ConstraintTask(), CharTokenizer()
    prompts = task.split("train")[:n_prompts]
    ids = encode_prompts(tok, prompts, model.config.prompt_len)
    return task, rollout(model, task, prompts, ids, group, steps, 1.0, torch.Generator().manual_seed(seed), schedule=SCHED)


def test_gaussian_log_prob_matches_torch_normal() -> None:
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    std = torch.rand(7, 1, generator=g) + 0.05
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).sum(-1)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), ref, rtol=1e-6, atol=1e-6)


def test_scoring_a_recorded_step_reproduces_its_log_prob() -> None:
    model = tiny_policy()
    _, batch = recorded(model)
    k = batch.num_steps
    with torch.no_grad():
        for step in range(k):  # same rows, same arithmetic: bit-for-bit
            _, lp, _, _ = ddim_step(model, batch.latents[:, step], batch.timesteps[step], batch.timesteps[step + 1],
                                    batch.prompt_ids, batch.eta, prev_sample=batch.latents[:, step + 1], schedule=SCHED)
            assert torch.equal(lp, batch.logp[:, step])
        # the learner's layout: all (trajectory, step) rows at once, in a shuffled order
        perm = torch.randperm(len(batch) * k, generator=torch.Generator().manual_seed(1))
        traj, step_idx = perm // k, perm % k
        scored = score_steps(model, batch, traj, step_idx, SCHED)
    torch.testing.assert_close(scored, batch.logp[traj, step_idx], rtol=1e-6, atol=1e-5)
    assert torch.isfinite(batch.logp).all()
    # sampling really is a Gaussian draw around the mean: the last state sits within a few std
    _, _, mean, std = ddim_step(model, batch.latents[:, -2], batch.timesteps[-2], batch.timesteps[-1],
                                batch.prompt_ids, batch.eta, prev_sample=batch.latents[:, -1], schedule=SCHED)
    z = (batch.latents[:, -1] - mean) / std
    assert float(z.abs().max().detach()) < 6 and float(z.std().detach()) > 0.3


class GaussianEps(nn.Module):
    """The exact optimal eps-predictor for data ~ N(mu, s^2 I): E[eps | x_t]."""

    def __init__(self, mu: torch.Tensor, s: float) -> None:
        super().__init__()
        self.mu, self.s = mu, s

    def forward(self, x_t, t, cond):
        ab = SCHED.alpha_bar(t)[:, None]
        var = ab * self.s**2 + 1 - ab
        return (1 - ab).sqrt() * (x_t - ab.sqrt() * self.mu) / var


def analytic_flow(x_init: torch.Tensor, mu: torch.Tensor, s: float) -> torch.Tensor:
    """Exact probability-flow map from t = T-1 to t = 0 for Gaussian data (affine in x)."""
    ab_hi, ab_lo = SCHED.alpha_bar(SCHED.num_timesteps - 1), SCHED.alpha_bar(0)
    v_hi, v_lo = ab_hi * s**2 + 1 - ab_hi, ab_lo * s**2 + 1 - ab_lo
    return ab_lo.sqrt() * mu + (v_lo / v_hi).sqrt() * (x_init - ab_hi.sqrt() * mu)


def test_ddim_ode_recovers_the_analytic_gaussian_solution() -> None:
    mu = torch.tensor([1.5, -0.5, 0.25])
    x_init = torch.randn(8000, 3, generator=torch.Generator().manual_seed(0))
    cond = torch.zeros(8000, 1, dtype=torch.long)
    # a point mass (s -> 0): DDIM is exact for any number of steps
    point = GaussianEps(mu, 0.0)
    for k in (1, 3, 8):
        out = sample_ode(point, cond, k, x_init=x_init, schedule=SCHED)
        torch.testing.assert_close(out, analytic_flow(x_init, mu, 0.0), rtol=1e-4, atol=1e-4)
    # s = 0.5: DDIM is a first-order solver of the probability-flow ODE: the deterministic map
    # converges to the exact one at rate ~1/K, and the mean is right at any K
    model, exact = GaussianEps(mu, 0.5), analytic_flow(x_init, mu, 0.5)

    def err(k: int, order: int) -> float:
        return float((sample_ode(model, cond, k, x_init=x_init, schedule=SCHED, order=order) - exact).abs().mean())

    ddim = {k: err(k, 1) for k in (10, 25, 100)}
    assert ddim[100] < ddim[25] < ddim[10] and ddim[25] / ddim[100] > 3 and ddim[100] < 0.015, ddim
    out = sample_ode(model, cond, 100, x_init=x_init, schedule=SCHED)
    torch.testing.assert_close(out.mean(0), exact.mean(0), atol=1e-3, rtol=0)
    assert abs(float(out.std(0).mean() / exact.std(0).mean()) - 1) < 0.03
    # the second-order multistep solver (same network calls) is far closer at few steps
    dpm = {k: err(k, 2) for k in (10, 25)}
    assert dpm[25] < ddim[25] / 3 and dpm[10] < ddim[10] / 3, (dpm, ddim)
    # the eta=1 SDE with many steps samples the same Gaussian (looser: Monte Carlo, and ancestral
    # sampling with 100 steps still under-disperses by a few percent)
    target_std = float(exact.std(0).mean())
    sde = sample_sde(model, ["p"] * 4000, cond[:4000], 100, 1.0, torch.Generator().manual_seed(1), schedule=SCHED,
                     latent_dim=3)
    torch.testing.assert_close(sde.samples.mean(0), mu * SCHED.alpha_bar(0).sqrt(), atol=0.05, rtol=0)
    assert abs(float(sde.samples.std(0).mean()) - target_std) < 0.08 * target_std


def test_eta_zero_cannot_score_and_steps_must_decrease() -> None:
    model = tiny_policy()
    x, cond = torch.randn(2, 4), torch.zeros(2, model.config.prompt_len, dtype=torch.long)
    with pytest.raises(ValueError, match="eta=0"):
        ddim_step(model, x, 10, 5, cond, 0.0, prev_sample=x)
    with pytest.raises(ValueError, match="t > t_prev"):
        ddim_step(model, x, 5, 10, cond, 1.0)
    grid = SCHED.grid(25)
    assert grid[0] == SCHED.num_timesteps - 1 and grid[-1] == 0 and bool((grid[:-1] > grid[1:]).all())


def test_update_policy_changes_only_lora_and_follows_the_advantage() -> None:
    base = tiny_policy()
    model = add_lora(base, r=4, alpha=8, targets=LORA_TARGETS)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    lora = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    _, batch = recorded(model, n_prompts=4, group=6, steps=8)
    k = batch.num_steps
    traj, step = torch.arange(len(batch)).repeat_interleave(k), torch.arange(k).repeat(len(batch))
    with torch.no_grad():
        before = score_steps(model, batch, traj, step, SCHED)
    opt = torch.optim.Adam(trainable_parameters(model), lr=3e-3)
    cfg = UpdateConfig(clip_eps=0.2, num_minibatches=2, row_chunk=16, std_normalize=True)
    stats = update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), SCHED, own=AdpoSettings(step_fraction=0.5))
    assert stats["rows"] == len(batch) * math.ceil(0.5 * k) and stats["iw_max"] == pytest.approx(1.0)
    after = model.state_dict()
    assert all(torch.equal(v, after[n]) for n, v in frozen.items()), "a base weight changed"
    assert any(not torch.equal(v, after[n]) for n, v in lora.items()), "no LoRA weight changed"
    with torch.no_grad():
        delta = (score_steps(model, batch, traj, step, SCHED) - before).view(len(batch), k).sum(1)
    adv = batch.advantage
    # the policy moved towards positively advantaged trajectories
    assert float((delta * adv).sum()) > 0


def test_stale_behaviour_log_probs_are_importance_weighted_and_capped() -> None:
    model = add_lora(tiny_policy(), r=4, alpha=8, targets=LORA_TARGETS)
    _, batch = recorded(model, n_prompts=3, group=4, steps=4)
    batch.logp = batch.logp - 0.3  # behaviour policy mu gave these steps less mass than pi_prox
    opt = torch.optim.SGD(trainable_parameters(model), lr=0.0)
    cfg = UpdateConfig(is_cap=2.0, row_chunk=7)
    st = update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), SCHED)
    assert st["iw_mean"] == pytest.approx(math.exp(0.3), rel=1e-4)
    batch.logp = batch.logp - 5.0  # far off-policy: the weight is truncated at C
    st = update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), SCHED)
    assert st["iw_mean"] == pytest.approx(2.0, rel=1e-5) and st["iw_max"] > 100


def test_step_rows_subsample_and_reweight() -> None:
    rows = build_step_rows(5, 10, 0.3, torch.Generator().manual_seed(0))
    assert rows.traj.numel() == 5 * 3
    for b in range(5):
        sel = rows.traj == b
        assert float(rows.weight[sel].sum()) == pytest.approx(10.0)
        assert rows.step[sel].unique().numel() == 3 and int(rows.step.max()) < 10
    late = build_step_rows(2, 10, 1.0, torch.Generator().manual_seed(0), eligible=torch.arange(10) >= 6)
    assert late.step.tolist() == [6, 7, 8, 9] * 2 and float(late.weight.sum()) == 8.0


def test_task_split_is_disjoint_and_the_verifier_is_honest() -> None:
    task = ConstraintTask()
    train, test = task.split("train"), task.split("test")
    assert train and test and not set(train) & set(test)
    assert len(train) + len(test) == len(task.all_prompts) and 0.1 < len(test) / len(task.all_prompts) < 0.3
    assert all(is_test_prompt(p) for p in test) and not any(is_test_prompt(p) for p in train)
    u = torch.linspace(-1, 1, len(test))
    exact = task.solutions(test, u)
    assert task.success(test, exact).all() and float(task.reward(test, exact).min()) > -1e-5
    rep, demos = task.demonstrations(train, 8, seed=0)
    rate = float(task.success(rep, demos).float().mean())
    assert 0.1 < rate < 0.6, rate  # imperfect on purpose: most demos miss the tolerance
    with pytest.raises(ValueError, match="constraint-task prompt"):
        task.params(["a=1 b=2"])


def test_arrow_round_trip_and_schema_checks(tmp_path) -> None:
    model = tiny_policy()
    _, batch = recorded(model)
    batch.reward[0] = float("nan")
    store = continuous_store(f"file://{tmp_path / 'traj'}")  # the discrete store's commit protocol
    store.write_batch(batch, "batch-0")
    assert store.list_batches() == ["batch-0"] and store.commit_info("batch-0")["kind"] == "continuous_trajectory"
    back = store.read_batch("batch-0")
    path = Path(store.data_path("batch-0"))  # the object its marker names
    for name in ("prompt_ids", "latents", "timesteps", "logp", "group_id", "policy_version"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert torch.equal(back.reward.isnan(), batch.reward.isnan())
    torch.testing.assert_close(back.reward.nan_to_num(), batch.reward.nan_to_num())
    torch.testing.assert_close(back.advantage, batch.advantage)
    assert back.prompts == batch.prompts and back.eta == batch.eta
    table = pq.read_table(path)
    assert table.schema.field("latents").type == pa.list_(pa.float32())
    assert table.schema.metadata[b"miles.latent_shape"] == b"[7, 4]"
    # rescoring from the file reproduces the stored behaviour log-probs
    with torch.no_grad():
        lp = score_steps(model, back, torch.arange(len(back)), torch.full((len(back),), 2), SCHED)
    torch.testing.assert_close(lp, batch.logp[:, 2], rtol=1e-6, atol=1e-5)
    # a truncated latent row and a foreign kind are rejected, naming what is wrong
    short = table.set_column(table.column_names.index("latents"), "latents",
                             pa.array([r[:-1] for r in table.column("latents").to_pylist()], type=pa.list_(pa.float32())))
    with pytest.raises(ContinuousSchemaError, match="latents"):
        from_table(short.replace_schema_metadata(table.schema.metadata))
    meta = dict(table.schema.metadata)
    meta[b"miles.kind"] = b"discrete_trajectory"
    with pytest.raises(ContinuousSchemaError, match="miles.kind"):
        from_table(table.replace_schema_metadata(meta))
    with pytest.raises(BatchNotFoundError):
        store.read_batch("missing")
    with pytest.raises(BatchExistsError):  # a committed batch is never overwritten
        store.write_batch(batch, "batch-0")
    # a corrupt file is detected by its checksum and quarantined; the store keeps going
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptBatchError, match="sha256"):
        store.read_batch("batch-0")
    store.quarantine("batch-0", "truncated")
    assert store.list_batches() == [] and store.list_quarantined() == ["batch-0"]
    # a discrete batch is not a continuous one: the kind in its schema is refused, naming it
    from miles_core.storage import TrajectoryStore

    disc = TrajectoryStore(tmp_path / "disc")
    disc_bid = disc.write_batch(_discrete_batch(), "d0")
    foreign = continuous_store(str(tmp_path / "disc"))
    with pytest.raises(CorruptBatchError, match="miles.kind"):
        foreign.read_batch(disc_bid)


def _discrete_batch():
    from test_storage import make_batch

    return make_batch()


def test_table_of_a_batch_is_self_describing() -> None:
    _, batch = recorded(tiny_policy(), n_prompts=2, group=2, steps=3)
    t = to_table(batch)
    assert t.num_rows == 4 and len(t.column("latents")[0]) == 4 * 4 and len(t.column("behaviour_logp")[0]) == 3


def test_adpo_peak_memory_does_not_grow_with_steps_but_the_chain_does() -> None:
    from miles_core.memory import SavedTensorMeter

    model = add_lora(tiny_policy(), r=4, alpha=8, targets=LORA_TARGETS)
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    cfg = UpdateConfig(row_chunk=8, skip_zero_variance=False)
    adpo, chain = {}, {}
    for k in (4, 12):
        _, batch = recorded(model, n_prompts=2, group=2, steps=k)
        g = torch.Generator().manual_seed(0)
        adpo[k] = SavedTensorMeter(params).measure(lambda: update_policy(model, opt, batch, cfg, g, SCHED))

        def whole_chain() -> None:
            x, total = batch.latents[:, 0], torch.zeros(len(batch))
            for j in range(k):
                x, lp, _, _ = ddim_step(model, x, batch.timesteps[j], batch.timesteps[j + 1], batch.prompt_ids, 1.0, g,
                                        schedule=SCHED)
                total = total + lp
            (-(batch.advantage * total).mean()).backward()

        chain[k] = SavedTensorMeter(params).measure(whole_chain)
    assert adpo[4] > 0 and adpo[12] == adpo[4]
    assert chain[12] > 1.8 * chain[4]  # grows with K (plus a K-independent part)
