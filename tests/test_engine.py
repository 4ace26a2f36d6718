"""The rollout engine (samplers/sampler.py, miles_core/models/window.py): greedy output equals the plain
LLaDA-style reference, the learner rescoring an uncached rollout reproduces its log-probs exactly,
caches are exact where they must be and their gap is what the benchmark reports, a row does not
depend on its batch, the host never waits inside the step loop, and eos_stop skips finished rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tools.llada_reference import logp_gap, replay_decisions
from miles_core.algo.rows import score_rows
from miles_core.algo.update import as_draws
from miles_core.config import ConfigError, SamplerConfig
from miles_core.models.base import load_checkpoint
from miles_core.models.hf import init_tiny
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.models.window import attention_grid, logit_shift
from miles_core.samplers.hostreads import HostReads
from miles_core.samplers.sampler import sample as miles_sample
from miles_core.samplers.step import rebuild_state
from miles_core.tokenizer import CharTokenizer

FAMILIES = ("bidir_qwen3", "llada", "dream", "sdar")
TOK = CharTokenizer()
NSD = SamplerConfig(kind="nsd", threshold=0.9, max_per_step=4, block_size=8, temperature=1.0)


def sample(model, tok, prompts, cfg: SamplerConfig, *args, **kwargs):
    """The sampler, with a block-causal model (SDAR) decoding on its own attention blocks, as it
    must (the sampler refuses any other block size: test_sdar_decodes_on_its_attention_grid...)."""
    grid = attention_grid(model)
    if grid and cfg.block_size not in (0, grid):
        cfg = replace(cfg, block_size=grid)
    return miles_sample(model, tok, prompts, cfg, *args, **kwargs)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("engine")
    out = {f: load_checkpoint(init_tiny(f, Path(d) / f, seed=0)) for f in FAMILIES}
    torch.manual_seed(0)
    out["tiny"] = (TinyDenoiser(TinyConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                           max_len=64)), TOK)
    for m, _ in out.values():
        m.eval()
    return out


def prompts_for(tok, n: int, seed: int, lo: int = 3, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    bad = set(tok.forbidden_ids) | {tok.eos_id}
    ids = [i for i in range(min(tok.vocab_size, 90)) if i not in bad]
    return [[ids[int(j)] for j in torch.randint(0, len(ids), (int(torch.randint(lo, hi, (1,), generator=g)),),
                                                 generator=g)] for _ in range(n)]


def lora_with_random_b(base: torch.nn.Module) -> torch.nn.Module:
    """A LoRA (seed 0) whose B is random, so every adapter tensor has a gradient."""
    from miles_core.models.lora import add_lora

    torch.manual_seed(0)
    model = add_lora(base, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_the_reference(models: dict, family: str) -> None:
    model, tok = models[family]
    grid = attention_grid(model)  # SDAR decodes on its attention blocks (its reference does too)
    for seed, (length, block, steps) in enumerate([(16, 8, 16), (16, 16, 16), (24, 8, 24), (16, 8, 8)]):
        block = grid or block
        prompt = torch.randint(200, 100_000, (3, 6), generator=torch.Generator().manual_seed(seed))
        cfg = SamplerConfig(kind="static", steps=steps, block_size=block, temperature=0.0)
        got = sample(model, tok, prompt.tolist(), cfg, length, torch.Generator().manual_seed(0))
        _assert_reference_decisions(model, tok, prompt.tolist(), got, block, grid, (family, length, block, steps))


def _assert_reference_decisions(model, tok, prompts: list[list[int]], got, block: int, grid: int, where) -> None:
    """Every decision of every row is the reference's, except near-ties: gaps under 1e-5 in logits, ten
    times float32's rounding at these logits (~0.1), which cached and uncached forwards, threads and
    batch shapes may order either way. The tiny random LLaDA has the most (13 of 96 decisions)."""
    total = {"decisions": 0, "near_ties": 0, "mismatches": 0}
    for b, prompt in enumerate(prompts):
        r = replay_decisions(model, prompt, got.completion_ids[b], got.step_map[b], tok.mask_id, tok.forbidden_ids,
                             block, grid)
        total = {k: total[k] + r[k] for k in total}
    assert total["mismatches"] == 0, (where, total)
    assert total["near_ties"] <= 0.2 * total["decisions"], (where, total)  # the check still decides most


def test_sdar_decodes_on_its_attention_grid_whatever_the_prompt_length(models: dict) -> None:
    """Prompts of every length mod 4 in one batch: each row's decoding blocks are SDAR's attention
    blocks (absolute multiples of 4, the first partial), so no token is decoded while an earlier
    attention block still holds a mask, and greedy output equals SDAR's decoder row by row, at one
    step per token and at 2 steps per block."""
    model, tok = models["sdar"]
    assert attention_grid(model) == 4
    lens, length = [4, 5, 6, 7, 9], 12
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(200, 100_000, (n,), generator=g).tolist() for n in lens]
    static = SamplerConfig(kind="static", steps=length, block_size=4, temperature=0.0)
    for cfg in (static, replace(NSD, block_size=4, max_per_step=4), replace(NSD, block_size=0, cache="prefix")):
        batch = sample(model, tok, prompts, cfg, length, torch.Generator().manual_seed(0))
        for b, p in enumerate(lens):
            blk = (p + torch.arange(length)) // 4                            # attention block of each position
            sm = batch.step_map[b]
            earlier = blk[None, :] < blk[:, None]                             # [c, c'] c' in an earlier block
            assert (sm[None, :].expand(length, -1)[earlier] < sm[:, None].expand(-1, length)[earlier]).all(), (cfg, p)
    # one step a token, and 2 steps per 4-block: SDAR's get_num_transfer_tokens(4, 2) = [2, 2] even in a
    # partial block (tests/test_sdar_schedule.py checks that rule where no near-tie can decide it)
    for steps in (length, 2 * length // 4):
        batch = sample(model, tok, prompts, replace(static, steps=steps), length, torch.Generator().manual_seed(0))
        _assert_reference_decisions(model, tok, prompts, batch, 4, 4, ("sdar", steps))
    with pytest.raises(ConfigError, match="attention blocks"):
        miles_sample(model, tok, prompts, replace(static, block_size=8), length, torch.Generator())


@pytest.mark.parametrize("family", [*FAMILIES, "tiny"])
def test_learner_scores_equal_the_uncached_rollout(models: dict, family: str) -> None:
    """The learner rescoring each recorded step (no cache) reproduces the recorded log-prob to float32
    rounding: the same arithmetic (z[token] - logsumexp z), but BLAS and attention kernels round a
    row differently in batches of different shapes (one state alone vs twice in a batch differs by
    ~1e-7 here), and the learner batches (trajectory, step) rows, the sampler trajectories."""
    model, tok = models[family]
    for cfg in (NSD, SamplerConfig(kind="static", steps=8, block_size=8, temperature=1.0)):
        batch = sample(model, tok, prompts_for(tok, 4, 1), cfg, 16, torch.Generator().manual_seed(0))
        for b in range(len(batch)):
            k = int(batch.num_steps[b])
            with torch.no_grad():
                lp, _, commit = score_rows(model, batch, torch.full((k,), b), torch.arange(k), tok, cfg.temperature)
            torch.testing.assert_close(lp[commit], batch.logp[torch.full((k,), b)][commit], atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", [*FAMILIES, "tiny"])
def test_caches_are_exact_while_the_rest_of_the_sequence_is_unchanged(models: dict, family: str) -> None:
    model, tok = models[family]
    m = getattr(model, "window")
    ids = torch.randint(4, 80, (2, 20))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False
    s = 8 - logit_shift(model)  # Dream reads position 8's logits at 7: its query starts there
    with torch.no_grad():
        full = model(ids, mask)
        _, prefix = m(ids, mask, (0, 20), (8, 12), keep=((0, s),))
        _, dual = m(ids, mask, (0, 20), (8, 12), keep=((0, s), (12, 20)))
        after_prefix, _ = m(ids, mask, (s, 20), (8, 12), cache=prefix)
        after_dual, _ = m(ids, mask, (s, 12), (8, 12), cache=dual)
    torch.testing.assert_close(after_prefix, full[:, 8:12], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after_dual, full[:, 8:12], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bidir_qwen3", "dream", "tiny"])
def test_a_cache_changes_only_steps_after_the_first_of_a_block_and_its_gap_is_measured(models: dict, family: str) -> None:
    model, tok = models[family]
    prompts = prompts_for(tok, 6, 2)
    none = logp_gap(model, tok, prompts, NSD, 16)
    assert none[1] < 2e-5  # no cache: float32 rounding of a different batch shape only
    for mode in ("prefix", "dual"):
        cfg = replace(NSD, cache=mode)
        batch = sample(model, tok, prompts, cfg, 16, torch.Generator().manual_seed(0))
        firsts = []
        for b in range(len(batch)):  # the first step of each block is a full pass: exact there
            starts = [int(batch.step_map[b, lo:lo + 8].min()) for lo in (0, 8)]
            k = torch.tensor(starts)
            with torch.no_grad():
                lp, _, commit = score_rows(model, batch, torch.full((2,), b), k, tok, 1.0)
            firsts.append(float((lp[commit] - batch.logp[torch.full((2,), b)][commit]).abs().max()))
        assert max(firsts) < 2e-5, (family, mode, firsts)
        mean, p99 = logp_gap(model, tok, prompts, cfg, 16)
        assert 100 * none[0] < mean <= p99 < 1.0, (family, mode, mean, p99)  # approximate: the benchmark reports it


@pytest.mark.parametrize("family", ["bidir_qwen3", "sdar", "tiny"])
@pytest.mark.parametrize("mode", ["static", "nsd", "prefix", "dual"])
def test_a_rows_rollout_does_not_depend_on_its_batch(models: dict, family: str, mode: str) -> None:
    model, tok = models[family]
    cfg = SamplerConfig(kind="static", steps=8, block_size=8, temperature=0.0) if mode == "static" else \
        replace(NSD, temperature=0.0, cache="none" if mode == "nsd" else mode)
    prompts = prompts_for(tok, 5, 3, lo=2, hi=12)
    together = sample(model, tok, prompts, cfg, 16, torch.Generator().manual_seed(0))
    for i, p in enumerate(prompts):
        alone = sample(model, tok, [p], cfg, 16, torch.Generator().manual_seed(0))
        assert torch.equal(alone.completion_ids[0], together.completion_ids[i]), (family, mode, i)
        assert torch.equal(alone.step_map[0], together.step_map[i]) and torch.equal(alone.nfe[0], together.nfe[i])
        torch.testing.assert_close(alone.logp[0], together.logp[i], atol=1e-5, rtol=1e-5)


def test_the_host_reads_nothing_inside_a_static_blocks_steps(models: dict) -> None:
    model, tok = models["bidir_qwen3"]
    prompts = prompts_for(tok, 3, 4)
    counts = {}
    for steps in (4, 16):
        with HostReads() as h:
            sample(model, tok, prompts, SamplerConfig(kind="static", steps=steps, block_size=8), 16,
                   torch.Generator().manual_seed(0))
        counts[steps] = h.count
    assert counts[4] == counts[16] == 2  # one read per block, however many steps
    with HostReads() as h:
        b = sample(model, tok, prompts, NSD, 16, torch.Generator().manual_seed(0))
    # NSD (4 a step at most, blocks of 8): no read before a block's second step, then at most one
    # per step after it, each a nonzero and a scalar; never more than the block's own steps
    steps = int(b.nfe.max())
    assert 2 <= h.count <= 2 * (1 + 2 * (steps - 1)), (h.count, b.nfe)


def test_host_reads_sees_the_operators_that_would_wait_for_a_device() -> None:
    x = torch.tensor([1, 2, 3])
    with HostReads() as h:
        x.sum().item()
        x.nonzero()
        _ = x[x > 1]
        _ = x + 1
    assert h.by_op == {"scalar": 1, "nonzero": 1, "bool_index": 1}


def test_eos_stop_skips_the_blocks_after_a_rows_eos_and_never_scores_them(models: dict) -> None:
    model, tok = models["tiny"]
    with torch.no_grad():  # make EOS the only choice: every position commits EOS at once
        model.lm_head.bias.zero_()
        model.lm_head.bias[tok.eos_id] = 50.0
    try:
        prompts = prompts_for(tok, 2, 5)
        base = SamplerConfig(kind="nsd", threshold=0.5, max_per_step=8, block_size=4, temperature=1.0)
        full = sample(model, tok, prompts, base, 16, torch.Generator().manual_seed(0))
        cut = sample(model, tok, prompts, replace(base, eos_stop=True), 16, torch.Generator().manual_seed(0))
    finally:
        with torch.no_grad():
            model.lm_head.bias.zero_()
    assert full.nfe.tolist() == [4, 4] and cut.nfe.tolist() == [1, 1]   # one step per block vs the first only
    assert (cut.completion_ids == tok.eos_id).all() and (cut.step_map[:, 4:] == -1).all()
    state = rebuild_state(cut.completion_ids, cut.step_map, torch.tensor([1, 1]), tok.mask_id)
    assert (state[:, 4:] == tok.mask_id).all()  # skipped positions are never revealed in a recorded state


def test_a_cache_on_a_model_without_one_is_refused() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Embedding(TOK.vocab_size, TOK.vocab_size)

        def forward(self, ids, mask=None):
            return self.w(ids)

    with pytest.raises(ConfigError, match="sampler.cache"):
        sample(Plain(), TOK, [[5, 6]], SamplerConfig(cache="prefix", steps=4), 4, torch.Generator())
    out = sample(Plain(), TOK, [[5, 6]], SamplerConfig(steps=4), 4, torch.Generator().manual_seed(0))
    assert (out.step_map >= 0).all()


def test_step_merge_rows_group_s_consecutive_steps_at_the_first_ones_state() -> None:
    from miles_core.algo.rows import RecordedStep, row_inputs
    from miles_core.algo.step_choice import build_rows
    from miles_core.types import TrajectoryBatch

    step_map = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 0, 1, 2, 0, 2]])       # K = 5 and 3 steps
    comp = torch.arange(10, 22).view(2, 6)
    batch = TrajectoryBatch(prompt_ids=[[5], [6]], completion_ids=comp, step_map=step_map, logp=torch.zeros(2, 6),
                            nfe=torch.tensor([5, 3]), group_id=torch.tensor([0, 0]), policy_version=torch.zeros(2).long())
    rows = build_rows(batch, 1.0, as_draws(torch.Generator(), len(batch)), merge=2)
    assert rows.traj.tolist() == [0, 0, 0, 1, 1] and rows.step.tolist() == [0, 1, 2, 0, 1]   # ceil(5/2), ceil(3/2)
    x, _, width, commit = row_inputs(batch, rows.traj, rows.step, TOK, RecordedStep(rows.bounds))
    m = TOK.mask_id
    assert commit.long().tolist() == [[1, 1, 0, 0, 0, 1], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0],
                                      [1, 1, 1, 0, 1, 0], [0, 0, 0, 1, 0, 1]]
    assert x[1, width:].tolist() == [10, 11, m, m, m, 15]                   # before step 2: steps 0, 1 revealed
    assert x[4, width:].tolist() == [16, 17, 18, m, 20, m]                  # before step 2 of trajectory 1


def test_a_merged_row_is_scored_against_the_proximal_policy_not_the_recorded_mu(models: dict) -> None:
    from miles_core.algo.rows import MaskedStepRows, RecordedStep
    from miles_core.algo.step_choice import build_rows

    model, tok = models["tiny"]
    batch = sample(model, tok, prompts_for(tok, 2, 6), NSD, 16, torch.Generator().manual_seed(0))
    merged = build_rows(batch, 1.0, as_draws(torch.Generator(), len(batch)), merge=2)
    one, two = MaskedStepRows(batch, tok, 1.0, RecordedStep()), MaskedStepRows(batch, tok, 1.0, RecordedStep(merged.bounds))
    idx = torch.tensor([0, 1])
    assert torch.equal(one.behaviour(idx, idx), batch.logp[idx]) and two.behaviour(idx, idx).isnan().all()


def test_covering_rows_partition_every_step_into_near_equal_runs() -> None:
    """rho = 0.5: K = 5 -> 3 runs (2, 2, 1 in some order), K = 3 -> 2 runs, K = 4 -> 2 runs of 2;
    every committed token scored once, a one-step run exact (its recorded mu), a longer one not."""
    from miles_core.algo.rows import RecordedStep, row_inputs
    from miles_core.algo.step_choice import build_rows
    from miles_core.types import TrajectoryBatch

    step_map = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 0, 1, 2, 0, 2], [3, 2, 1, 0, 3, 1]])   # K = 5, 3, 4
    comp = torch.arange(10, 28).view(3, 6)
    logp = -torch.rand(3, 6)
    batch = TrajectoryBatch(prompt_ids=[[5], [6], [7]], completion_ids=comp, step_map=step_map, logp=logp,
                            nfe=torch.tensor([5, 3, 4]), group_id=torch.tensor([0, 0, 0]),
                            policy_version=torch.zeros(3).long())
    runs = set()
    for seed in range(30):
        rows = build_rows(batch, 0.5, as_draws(torch.Generator().manual_seed(seed), len(batch)), cover=True)
        assert rows.traj.tolist() == [0, 0, 0, 1, 1, 2, 2] and rows.weight.tolist() == [1.0] * 7
        view = RecordedStep(rows.bounds)
        _, _, _, commit = row_inputs(batch, rows.traj, rows.step, TOK, view)
        for b in range(3):
            assert torch.equal(commit[rows.traj == b].long().sum(0), torch.ones(6, dtype=torch.long))  # each token once
        first, end = view.span(rows.traj, rows.step)
        lengths = (end - first).tolist()
        runs.add(tuple(lengths[:3]))
        assert sorted(lengths[:3]) == [1, 2, 2] and sorted(lengths[3:5]) == [1, 2] and lengths[5:] == [2, 2]
        mu = view.behaviour(batch, rows.traj, rows.step)
        single = torch.tensor(lengths) == 1
        assert torch.equal(mu[single], logp[rows.traj[single]]) and mu[~single].isnan().all()
        x, _, width, _ = row_inputs(batch, rows.traj, rows.step, TOK, view)
        m = TOK.mask_id
        k = int(first[6])  # trajectory 2's second run starts at step 2: steps 0, 1 revealed
        assert k == 2 and x[6, width:].tolist() == [m, m, 24, 25, m, 27]
    assert runs == {(1, 2, 2), (2, 1, 2), (2, 2, 1)}      # the one-step run lands anywhere


def test_covering_rows_at_rho_one_are_every_step_exactly(models: dict) -> None:
    from miles_core.algo.step_choice import build_rows

    model, tok = models["tiny"]
    batch = sample(model, tok, prompts_for(tok, 3, 5), NSD, 16, torch.Generator().manual_seed(0))
    a = build_rows(batch, 1.0, as_draws(torch.Generator().manual_seed(4), len(batch)), cover=True)
    b = build_rows(batch, 1.0, as_draws(torch.Generator().manual_seed(4), len(batch)), cover=False)
    assert a.bounds is None and b.bounds is None
    assert torch.equal(a.traj, b.traj) and torch.equal(a.step, b.step) and torch.equal(a.weight, b.weight)


def test_covering_update_at_half_the_steps_is_tracerl_merging_by_two_when_k_is_even(models: dict) -> None:
    """K = 4 for every trajectory: rho = 0.5 covering rows are runs of 2, TraceRL's s = 2 at rho = 1;
    the two configurations take the same gradient, and it differs from scoring half the steps exactly."""
    from miles_core.algo.update import update_policy
    from miles_core.config import AdpoSettings, UpdateConfig

    base, tok = models["tiny"]
    batch = sample(base, tok, prompts_for(tok, 4, 9, lo=4, hi=7), SamplerConfig(steps=4), 16,
                   torch.Generator().manual_seed(0))
    assert batch.num_steps.tolist() == [4, 4, 4, 4]
    batch.advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = {}
    for name, own in {"cover": AdpoSettings(step_fraction=0.5), "merge2": AdpoSettings(step_fraction=1.0, step_merge=2),
                      "sampled": AdpoSettings(step_fraction=0.5, step_cover=False)}.items():
        model = lora_with_random_b(base)
        params = [p for p in model.parameters() if p.requires_grad]
        stats = update_policy(model, torch.optim.SGD(params, lr=0.0), batch, UpdateConfig(max_grad_norm=1e9), tok, 1.0,
                              torch.Generator().manual_seed(0), own=own)
        assert stats["rows"] == 8.0
        grads[name] = torch.cat([p.grad.flatten() for p in params])
        model.unload()
    assert grads["cover"].isfinite().all()
    torch.testing.assert_close(grads["cover"], grads["merge2"], atol=1e-7, rtol=1e-5)
    assert not torch.allclose(grads["cover"], grads["sampled"], atol=1e-4)


def test_chunk_tokens_bounds_each_chunk_and_leaves_the_gradient_unchanged(models: dict) -> None:
    from miles_core.algo.update import update_policy
    from miles_core.config import UpdateConfig

    base, tok = models["tiny"]
    batch = sample(base, tok, prompts_for(tok, 4, 7, lo=5, hi=6), NSD, 16, torch.Generator().manual_seed(0))
    batch.advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, chunks = {}, {}
    for budget in (0, 21 * 3):  # 0: row_chunk (all rows at once); 63 positions: 3 rows of 5 + 16 per chunk
        model = lora_with_random_b(base)
        seen = []
        h = model.base_model.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
        params = [p for p in model.parameters() if p.requires_grad]
        update_policy(model, torch.optim.SGD(params, lr=0.0), batch, UpdateConfig(chunk_tokens=budget, max_grad_norm=1e9),
                    tok, 1.0, torch.Generator().manual_seed(0))
        h.remove()
        grads[budget] = torch.cat([p.grad.flatten() for p in params])
        chunks[budget] = seen
        model.unload()
    assert max(chunks[63]) == 3 and len(chunks[0]) == 1
    torch.testing.assert_close(grads[0], grads[63], atol=1e-6, rtol=1e-4)


def test_scoring_at_committed_positions_equals_scoring_the_whole_completion(models: dict) -> None:
    from miles_core.algo.rows import RECORDED, row_inputs
    from miles_core.samplers.step import denoise_step

    model, tok = models["dream"]  # the shifted family: the gathered positions read i - 1
    batch = sample(model, tok, prompts_for(tok, 3, 8), NSD, 16, torch.Generator().manual_seed(0))
    traj, step = torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 0, 2])
    with torch.no_grad():
        lp, ent, commit = score_rows(model, batch, traj, step, tok, 1.0)
        x, attn, width, _ = row_inputs(batch, traj, step, tok, RECORDED)
        full = denoise_step(model, x, attn, width, temperature=1.0, forbidden=tok.forbidden_ids,
                            tokens=batch.completion_ids[traj])
    torch.testing.assert_close(lp[commit], full.logp[commit], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[commit], full.entropy[commit], atol=1e-4, rtol=1e-4)
    assert (lp[~commit] == 0).all()


def test_a_bf16_base_samples_and_trains_with_fp32_adapters(tmp_path: Path) -> None:
    from miles_core.algo.update import update_policy
    from miles_core.config import UpdateConfig
    from miles_core.models.lora import add_lora

    base, tok = load_checkpoint(init_tiny("bidir_qwen3", tmp_path / "m", seed=0), dtype="bfloat16")
    assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
    for p in base.parameters():
        p.requires_grad_(False)
    model = add_lora(base, r=4, alpha=8)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and {p.dtype for p in params} == {torch.float32}   # peft keeps adapters in float32
    batch = sample(model, tok, prompts_for(tok, 2, 9), NSD, 16, torch.Generator().manual_seed(0))
    assert batch.logp.dtype == torch.float32 and torch.isfinite(batch.logp).all()
    batch.advantage = torch.tensor([1.0, -1.0])
    stats = update_policy(model, torch.optim.AdamW(params, lr=1e-3), batch, UpdateConfig(), tok, 1.0,
                        torch.Generator().manual_seed(0))
    assert stats["rows"] > 0 and all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
