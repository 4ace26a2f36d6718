"""Data-parallel primitives (miles_core/parallel.py) and a global batch read in shares
(miles_core/learner/shares.py), in one process: the size-1 world is a no-op, the shares partition
the batches, a skeleton carries what the rows are drawn from, and ``owned`` picks a rank's rows so
that the ranks' gradients add up to one process's. Real ranks under torchrun:
tests/test_learner_ranks.py."""

from __future__ import annotations

import pytest
import torch

from miles_core.algo.advantages import group_advantages
from miles_core.algo.update import adpo_update
from miles_core.config import ADPOConfig, SamplerConfig
from miles_core.learner.shares import agree, first_reader, my_share, owned_rows, row_meta, skeleton
from miles_core.models.lora import add_lora
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.parallel import World
from miles_core.samplers.sampler import sample
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

TOK = CharTokenizer()
CFG = ADPOConfig(num_minibatches=2, row_chunk=3, step_fraction=0.5, kl_coef=0.1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return add_lora(TinyDenoiser(TinyConfig(TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=40)), 4, 8)


def _batch(model: torch.nn.Module) -> TrajectoryBatch:
    prompts = [TOK.encode(p) for p in ("1+2", "3*45", "7-1") for _ in range(4)]  # prompts of different lengths
    batch = sample(model, TOK, prompts, SamplerConfig(steps=4), 8, torch.Generator().manual_seed(0),
                   torch.arange(3).repeat_interleave(4))
    batch.reward = torch.tensor([0.0, 1.0, 2.0, 0.5] * 3)
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    return batch


def _update(batch: TrajectoryBatch, owned: torch.Tensor | None = None, world: World | None = None,
            cfg: ADPOConfig = CFG):
    model = _model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    stats = adpo_update(model, opt, batch, cfg, TOK, 1.0, torch.Generator().manual_seed(1), world=world, owned=owned)
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_world_of_size_one_is_bit_identical_to_no_world() -> None:
    batch = _batch(_model())
    (a, wa), (b, wb) = _update(batch), _update(batch, world=World())
    assert a == b and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ranks_own_equal_blocks_of_rows_and_read_only_the_batches_they_touch() -> None:
    # 7 sampler batches of 4 rows over 3 ranks: rows 0-8, 9-18, 19-27 (28 * r // 3 boundaries)
    owned = [torch.cat([owned_rows(j, 4, 7, World(r, 3)) for j in range(7)]) for r in range(3)]
    assert [int(o.sum()) for o in owned] == [10, 9, 9] and bool(sum(o.int() for o in owned).eq(1).all())
    assert [my_share(7, 4, World(r, 3)) for r in range(3)] == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    assert [first_reader(2, 4, 7, World(r, 3)) for r in range(3)] == [True, False, False]
    # fewer batches than ranks: every rank still gets work, each reads one batch
    assert [my_share(1, 8, World(r, 4)) for r in range(4)] == [[0]] * 4
    assert [int(owned_rows(0, 8, 1, World(r, 4)).sum()) for r in range(4)] == [2, 2, 2, 2]


def test_a_skeleton_carries_what_the_rows_are_drawn_from_and_nothing_to_score() -> None:
    batch = _batch(_model())
    sk = skeleton(row_meta(batch))
    for name in ("step_map", "group_id", "policy_version", "reward", "advantage", "nfe"):
        assert torch.equal(getattr(sk, name), getattr(batch, name)), name
    assert [len(p) for p in sk.prompt_ids] == [len(p) for p in batch.prompt_ids] and sk.completions == batch.completions
    assert not sk.completion_ids.any() and not sk.logp.any()
    fates = agree(1, {0: (("fresh", 0), batch)}, World())  # one process: its own batch back, held
    assert fates[0][1] is batch and fates[0][2]


def test_the_rows_each_rank_owns_add_up_to_the_whole_update() -> None:
    """Two ranks' gradients, each over the rows of the trajectories it holds (the other rank's
    as a skeleton), summed: one process's gradient. Checked in one process with SGD at lr 1, so
    the parameter change is minus the gradient: (w0 - w_a) + (w0 - w_b) = w0 - w_full (one
    optimizer step and no clipping, which the real ranks apply after summing)."""
    cfg = ADPOConfig(num_minibatches=1, row_chunk=3, step_fraction=0.5, kl_coef=0.1, max_grad_norm=1e9)
    batch = _batch(_model())
    first = torch.arange(len(batch)) < 5  # a share boundary inside a prompt group
    _, full = _update(batch, cfg=cfg)
    _, w0 = _update(batch, owned=torch.zeros(len(batch), dtype=torch.bool), cfg=cfg)  # no rows scored: unchanged
    halves = []
    for mine in (first, ~first):
        parts = [batch.select(torch.arange(len(batch))[mine]), batch.select(torch.arange(len(batch))[~mine])]
        seen = TrajectoryBatch.concat([parts[0], skeleton(row_meta(parts[1]))])  # as this rank builds it
        order = torch.cat([torch.arange(len(batch))[mine], torch.arange(len(batch))[~mine]])
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        held = torch.zeros(len(batch), dtype=torch.bool)
        held[: int(mine.sum())] = True
        halves.append((seen.select(back), held[back]))  # the batch order every rank agrees on
    deltas = [_update(seen, owned=held, cfg=cfg)[1] for seen, held in halves]
    for k in full:
        summed = w0[k] - sum(w0[k] - d[k] for d in deltas)
        torch.testing.assert_close(summed, full[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(full[k], w0[k]) for k in full)


def test_several_ranks_without_owned_rows_are_refused() -> None:
    batch = _batch(_model())
    with pytest.raises(ValueError, match="needs `owned`"):
        _update(batch, world=World(0, 2))
