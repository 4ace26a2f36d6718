"""DiffusionGemma through transformers' own class: the renoising sampler is the
behaviour policy of ``model.generate``, its record rebuilds every state, scoring reproduces it,
and an ADPO update trains the decoder's LoRA only. A tiny random-init DiffusionGemmaConfig with the
real fields (sliding and full layers, MoE beside the dense MLP, self-conditioning) stands in for
google/diffusiongemma-26B-A4B-it, which nothing here can download."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from miles_core.algo.renoise_rows import RenoiseStepRows, action_rows
from miles_core.algo.update import update_policy
from miles_core.config import AdpoSettings, RenoiseConfig, UpdateConfig
from miles_core.models import canvas
from miles_core.models import diffusion_gemma as dg
from miles_core.models.lora import add_lora
from miles_core.samplers import renoise as rn
from miles_core.storage.errors import SchemaError
from miles_core.storage.renoise import from_table, to_table
from miles_core.storage.trajectories import TrajectoryStore
from miles_core.types import RenoiseBatch
from miles_core.tokenizer import CharTokenizer

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]
TOK = CharTokenizer()
PROMPTS = ["12+3=", "7*8=", "1+1=", "9-4*2="]
# stability 0: the stop is the mean-entropy test alone, so rows of a random model stop at different steps
EARLY = RenoiseConfig(max_steps=10, entropy_bound=3.0, stability_threshold=0, confidence_threshold=4.556)
FULL = RenoiseConfig(max_steps=8, entropy_bound=2.0, confidence_threshold=0.005)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = dg.write_tiny_checkpoint(tmp_path_factory.mktemp("dg"), TOK, canvas_length=8, hidden=32, heads=2)
    m, tok = dg.load_diffusion_gemma(d)
    assert tok.vocab_size == TOK.vocab_size and type(m).__name__ == "DiffusionGemmaForBlockDiffusion"
    return m


def _ids(texts):
    return [TOK.encode(t) for t in texts]


def _generate(model, prompt, seed, cfg):
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, eos_token_id=TOK.eos_id,
                         pad_token_id=TOK.pad_id, **cfg.generate_kwargs())
    return out.sequences[0, len(prompt):]


@pytest.mark.parametrize("cfg", [EARLY, FULL], ids=["adaptive-stop", "max-steps"])
def test_sampler_is_generate_token_for_token(model, cfg):
    """A row with seed s equals torch.manual_seed(s); model.generate(row): the same draws, the same
    entropy-bound rule, temperature schedule and stopping, in a batch of padded rows too."""
    seeds = torch.tensor([11, 12, 13, 14])
    batch = rn.sample(model, TOK, _ids(PROMPTS), cfg, seeds)
    for i, p in enumerate(_ids(PROMPTS)):
        assert torch.equal(batch.completion_ids[i], _generate(model, p, int(seeds[i]), cfg)), PROMPTS[i]
    if cfg is EARLY:
        assert len(set(batch.num_steps.tolist())) > 1 and int(batch.num_steps.max()) < cfg.max_steps
    else:
        assert batch.num_steps.tolist() == [cfg.max_steps] * 4


def test_replayed_states_are_the_canvases_the_denoiser_saw(model, monkeypatch):
    """Every intermediate canvas is rebuilt exactly from the record and the seed (renoise replayed)."""
    seen: list[torch.Tensor] = []
    real = canvas.decode

    def spy(m, p, ids, soft):
        seen.append(ids.clone())
        return real(m, p, ids, soft)

    monkeypatch.setattr(canvas, "decode", spy)
    batch = rn.sample(model, TOK, _ids(PROMPTS[:1]), EARLY, torch.tensor([5]))
    states = rn.replay_states(batch, model.config.text_config.vocab_size, torch.device("cpu"))
    assert len(seen) == int(batch.num_steps[0]) >= 2
    for k, ids in enumerate(seen):
        assert torch.equal(states[0, k], ids[0]), k
    batch.sampler["rng_device"] = "cuda"   # drawn elsewhere: replaying here would rebuild other states
    with pytest.raises(ValueError, match="drawn by cuda generators"):
        rn.replay_states(batch, model.config.text_config.vocab_size, torch.device("cpu"))


def test_scoring_a_recorded_step_reproduces_its_logp(model):
    """Exactly at the sampler's shapes (one row a call); to float32 rounding in any batch."""
    batch = rn.sample(model, TOK, _ids(PROMPTS[:1]), EARLY, torch.tensor([3]))
    scorer = RenoiseStepRows(model, batch, EARLY, TOK)
    rows = action_rows(batch)
    assert rows.traj.numel() == int(batch.num_steps[0]) - 1
    with torch.no_grad():
        one = torch.cat([scorer.score(model, rows.traj[i:i + 1], rows.step[i:i + 1])[0]
                         for i in range(rows.traj.numel())])
    assert torch.equal(one, scorer.behaviour(rows.traj, rows.step))
    big = rn.sample(model, TOK, _ids(PROMPTS), EARLY, torch.tensor([1, 2, 3, 4]))
    scorer = RenoiseStepRows(model, big, EARLY, TOK)
    rows = action_rows(big)
    with torch.no_grad():
        logp, _, commit = scorer.score(model, rows.traj, rows.step)
    assert torch.equal(commit, big.accepted[rows.traj, rows.step])
    assert torch.allclose(logp, scorer.behaviour(rows.traj, rows.step), atol=1e-5, rtol=0)


def _chain_logp(model, batch, b, cfg):
    """Brute force: the chain of row b under ``model``, one step at a time, its own self-conditioning."""
    states = rn.replay_states(batch, model.config.text_config.vocab_size if hasattr(model, "config") else 0,
                              torch.device("cpu"))
    from miles_core.samplers.step import left_pad

    prompt, real = left_pad([batch.prompt_ids[b]], TOK.pad_id)
    enc = canvas.encode(model, prompt, real, batch.completion_len)
    soft, out = None, []
    for k in range(int(batch.num_steps[b]) - 1):
        z = canvas.decode(model, enc, states[b, k][None], soft) / rn.temperature(cfg, k, torch.device("cpu"))
        out.append(torch.where(batch.accepted[b, k], rn.token_logp(z[0], batch.tokens[b, k]), 0.0))
        soft = canvas.soft_embedding(model, z)
    return torch.stack(out)


def test_update_trains_decoder_lora_only_and_the_ratio_is_the_chain_ratio(model):
    """Only LoRA tensors change, all on the decoder; after the update the learner's log-probs are
    the exact chain log-probs of the new policy (self-conditioning rebuilt under it)."""
    import copy

    pm = add_lora(copy.deepcopy(model), r=4, alpha=8)
    names = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".decoder." in n for n in names)
    assert any("self_conditioning" in n for n in names)
    batch = rn.sample(pm, TOK, _ids(PROMPTS), EARLY, torch.tensor([7, 8, 9, 10]))
    batch.advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=3e-2)
    stats = update_policy(pm, opt, batch, UpdateConfig(num_minibatches=1, epochs=1), TOK, 1.0,
                        torch.Generator().manual_seed(0))   # the one entry: it sends a renoising batch on
    assert stats["rows"] == float(action_rows(batch).traj.numel()) and math.isfinite(stats["loss"])
    changed = {n for n, p in pm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n and ".decoder." in n for n in changed)
    scorer = RenoiseStepRows(pm, batch, EARLY, TOK)
    rows = action_rows(batch)
    with torch.no_grad():
        logp = scorer.score(pm, rows.traj, rows.step)[0]
        for b in range(len(batch)):
            mine = logp[rows.traj == b]
            assert torch.allclose(mine, _chain_logp(pm, batch, b, EARLY), atol=1e-5, rtol=0)
        assert (logp - scorer.behaviour(rows.traj, rows.step)).abs().max() > 1e-3   # the policy moved


@pytest.mark.parametrize("output", ["argmax", "sample"])
def test_the_output_row_scores_the_output_at_the_last_temperature(model, output):
    """``estimators.adpo.renoise_output``: one more row per trajectory, (b, K_b - 1), whose action is the output
    (generate's argmax, or with ``renoise.output="sample"`` the last step's sample) up to its first
    EOS, scored by brute force as log softmax(z_{K-1} / T_{K-1}) at the output tokens; it has no
    recorded behaviour (NaN); an update with it trains and counts its rows."""
    import copy

    cfg = dataclasses.replace(EARLY, output=output)
    batch = rn.sample(model, TOK, _ids(PROMPTS), cfg, torch.tensor([21, 22, 23, 24]))
    batch.completion_ids[1, 2] = TOK.eos_id       # a row whose output ends early: positions after EOS are not scored
    rows = action_rows(batch, output=True)
    assert rows.traj.numel() == int(batch.num_steps.sum())
    scorer = RenoiseStepRows(model, batch, cfg, TOK, output=True)
    states = rn.replay_states(batch, model.config.text_config.vocab_size, torch.device("cpu"))
    from miles_core.samplers.step import left_pad

    with torch.no_grad():
        logp, _, commit = scorer.score(model, rows.traj, rows.step)
        behav = scorer.behaviour(rows.traj, rows.step)
        for b in range(len(batch)):
            k = int(batch.num_steps[b]) - 1
            r = int(((rows.traj == b) & (rows.step == k)).nonzero())
            prompt, real = left_pad([batch.prompt_ids[b]], TOK.pad_id)
            enc = canvas.encode(model, prompt, real, batch.completion_len)
            soft = None
            for j in range(k + 1):      # the chain under the model, its own self-conditioning
                z = canvas.decode(model, enc, states[b, j][None], soft) / rn.temperature(cfg, j, torch.device("cpu"))
                soft = canvas.soft_embedding(model, z)
            want = torch.log_softmax(z[0].double(), -1).gather(-1, batch.completion_ids[b][:, None]).squeeze(-1)
            ids = batch.completion_ids[b].tolist()
            end = ids.index(TOK.eos_id) + 1 if TOK.eos_id in ids else len(ids)
            assert commit[r].tolist() == [i < end for i in range(len(ids))]
            assert torch.allclose(logp[r][:end].double(), want[:end], atol=1e-5)
            assert (logp[r][end:] == 0).all() and behav[r].isnan().all()
            others = rows.traj.eq(b) & rows.step.ne(k)
            assert not behav[others].isnan().any()
    pm = add_lora(copy.deepcopy(model), r=4, alpha=8)
    batch = rn.sample(pm, TOK, _ids(PROMPTS), cfg, torch.tensor([7, 8, 9, 10]))
    batch.advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=3e-2)
    stats = update_policy(pm, opt, batch, UpdateConfig(num_minibatches=1, epochs=1), TOK, 1.0,
                          torch.Generator().manual_seed(0), own=AdpoSettings(renoise_output=True))
    assert stats["rows"] == float(batch.num_steps.sum()) and math.isfinite(stats["loss"])


def test_hand_checked_rules():
    """Entropy-bound acceptance, the temperature schedule, EOS finalisation and the log-prob."""
    ent = torch.tensor([[0.5, 0.1, 2.0, 0.3]])
    # sorted 0.1, 0.3, 0.5, 2.0; cumsum - self = 0, 0.1, 0.4, 0.9 -> bound 0.45 keeps three
    assert rn.entropy_accept(ent, 0.45).tolist() == [[True, True, False, True]]
    assert rn.entropy_accept(ent, 0.05).tolist() == [[False, True, False, False]]   # one always passes
    cfg = RenoiseConfig(max_steps=4, t_min=0.4, t_max=0.8)
    assert [round(float(rn.temperature(cfg, k, torch.device("cpu"))), 6) for k in range(4)] == [0.8, 0.7, 0.6, 0.5]
    assert rn.finalize(torch.tensor([[5, 2, 7, 2, 9]]), eos_id=2, pad_id=0).tolist() == [[5, 2, 0, 0, 0]]
    z = torch.tensor([[1.0, 2.0, 3.0]])
    want = 2.0 - math.log(math.e + math.e ** 2 + math.e ** 3)
    assert abs(float(rn.token_logp(z, torch.tensor([1]))) - want) < 1e-6


def test_record_round_trips_through_the_store_and_bad_rows_are_named(model, tmp_path):
    batch = rn.sample(model, TOK, _ids(PROMPTS), EARLY, torch.tensor([1, 2, 3, 4]))
    batch.reward = torch.tensor([1.0, 0.0, float("nan"), 1.0])
    batch.meta = [{"answer": str(i)} for i in range(4)]
    store = TrajectoryStore(tmp_path / "store")   # the default codec holds either kind
    bid = store.write_batch(batch)
    back = store.read_batch(bid)
    for name in ("completion_ids", "accepted", "tokens", "logp", "num_steps", "seed", "group_id"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert back.prompt_ids == batch.prompt_ids and back.completions == batch.completions and back.meta == batch.meta
    assert torch.equal(back.reward.isnan(), batch.reward.isnan())
    assert store.commit_info(bid)["kind"] == "renoise_trajectory" and back.sampler == batch.sampler
    assert rn.settings(back) == EARLY and back.sampler["rng_device"] == "cpu"
    sampled = dataclasses.replace(EARLY, output="sample")
    back = store.read_batch(store.write_batch(rn.sample(model, TOK, _ids(PROMPTS), sampled, torch.tensor([1, 2, 3, 4]))))
    assert rn.settings(back) == sampled
    old = {k: v for k, v in batch.sampler.items() if k != "output"}   # a record from before the field
    assert rn.settings(dataclasses.replace(batch, sampler=old)) == EARLY
    table = to_table(batch)
    steps = table.column("num_steps").to_pylist()
    steps[1] += 1
    import pyarrow as pa

    bad = table.set_column(table.schema.get_field_index("num_steps"), table.schema.field("num_steps"),
                           pa.array(steps, type=pa.int32()))
    with pytest.raises(SchemaError, match="row 1"):
        from_table(bad)


def test_chains_sampled_alike_join_into_one_update_and_others_are_refused(model):
    """A global batch of several renoising sampler batches (async_rl.global_batch): concat keeps
    every row's action record; a batch sampled with other settings cannot join it."""
    one = rn.sample(model, TOK, _ids(PROMPTS[:2]), EARLY, torch.tensor([1, 2]))
    two = rn.sample(model, TOK, _ids(PROMPTS[2:]), EARLY, torch.tensor([3, 4]))
    for b in (one, two):
        b.reward, b.advantage = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5])
    both = RenoiseBatch.concat([one, two])
    assert len(both) == 4 and torch.equal(both.seed, torch.tensor([1, 2, 3, 4]))
    for name in ("accepted", "tokens", "logp", "num_steps", "completion_ids"):
        assert torch.equal(getattr(both, name)[2:], getattr(two, name)), name
    assert torch.equal(both.select([2, 3]).accepted, two.accepted)
    other = rn.sample(model, TOK, _ids(PROMPTS[:2]), dataclasses.replace(EARLY, output="sample"), torch.tensor([5, 6]))
    other.reward, other.advantage = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5])
    with pytest.raises(ValueError, match="other settings"):
        RenoiseBatch.concat([one, other])


def test_models_init_and_check_know_the_family(tmp_path):
    """``python -m miles_core.models init --family diffusion_gemma`` and ``miles models check``."""
    from miles_core.models.__main__ import init
    from miles_core.models.__main__ import check

    info = check(init("diffusion_gemma", str(tmp_path / "dg")))
    assert info["family"] == "diffusion_gemma" and info["finite"] and info["canvas_length"] == 24


def test_a_sampled_output_is_the_last_steps_draw_and_the_chain_is_unchanged(model):
    """``renoise.output="sample"``: the same chain as generate's (every state, acceptance and stop
    for the same seeds), but the output is the last step's sample y = argmax(softmax(z) / E) (E the
    row's Exp(1) draw of that step, replayed from its seed here), not the argmax of z; generate
    cannot return it, so its keyword arguments are refused."""
    from miles_core.samplers.step import left_pad

    sampled = dataclasses.replace(EARLY, output="sample")
    seeds = torch.tensor([31, 32, 33, 34])
    a = rn.sample(model, TOK, _ids(PROMPTS), EARLY, seeds)
    b = rn.sample(model, TOK, _ids(PROMPTS), sampled, seeds)
    for f in ("accepted", "tokens", "logp", "num_steps"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert not torch.equal(a.completion_ids, b.completion_ids)
    vocab = model.config.text_config.vocab_size
    states = rn.replay_states(b, vocab, torch.device("cpu"))
    with torch.no_grad():
        for i in range(len(b)):
            k_b, length = int(b.num_steps[i]), b.completion_len
            g = torch.Generator().manual_seed(int(seeds[i]))
            torch.randint(0, vocab, (length,), generator=g)                       # x_0
            for _ in range(k_b):                                                  # each step: Exp(1), then renoise
                e = torch.empty(length, vocab).exponential_(1, generator=g)
                torch.randint(0, vocab, (length,), generator=g)
            prompt, real = left_pad([b.prompt_ids[i]], TOK.pad_id)
            enc = canvas.encode(model, prompt, real, length)
            soft = None
            for j in range(k_b):
                z = canvas.decode(model, enc, states[i, j][None], soft) / rn.temperature(sampled, j, torch.device("cpu"))
                soft = canvas.soft_embedding(model, z)
            y = (torch.softmax(z[0], -1, dtype=torch.float32) / e).argmax(-1)
            assert torch.equal(b.completion_ids[i], rn.finalize(y, TOK.eos_id, TOK.pad_id)), PROMPTS[i]
            assert torch.equal(a.completion_ids[i], rn.finalize(z[0].argmax(-1), TOK.eos_id, TOK.pad_id))
    with pytest.raises(ValueError, match="renoise.output='sample'"):
        sampled.generate_kwargs()


def test_evaluation_decodes_with_the_argmax_whatever_the_rl_chains_output(monkeypatch):
    """``renoise.output="sample"`` changes what RL chains return, not how a model is evaluated:
    ``run_eval`` hands the renoising sampler generate's argmax output."""
    import miles_core.eval.evaluate as E
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    seen = []
    monkeypatch.setattr(E, "evaluate", lambda *a, **k: seen.append(k["renoise"]))
    cfg = load_recipe("tiny", ["renoise.output=sample", "estimators.adpo.renoise_output=true", "renoise.max_steps=7"])
    E.run_eval(None, TOK, cfg, build_task(cfg))
    assert seen == [dataclasses.replace(cfg.renoise, output="argmax")] and seen[0].max_steps == 7
