"""Data-parallel primitives (miles_core/parallel.py) and a global batch read in shares
(miles_core/learner/shares.py), in one process: the size-1 world is a no-op, the shares partition
the batches in whole groups, and a trajectory's draws do not depend on the batch around it. Real
ranks under torchrun (each rank's update on its share adds up to one process's):
tests/test_learner_ranks.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from miles_core.algo.advantages import group_advantages
from miles_core.algo.update import update_policy
from miles_core.config import AdpoSettings, SamplerConfig, UpdateConfig
from miles_core.algo.draws import Draws, minibatches, trajectory_keys
from miles_core.algo.step_choice import build_rows
from miles_core.learner.shares import RankSpeeds, agree, cuts, first_reader, my_share, owned_units, owned_rows
from miles_core.learner.ledger import Verdict
from miles_core.models.lora import add_lora
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.parallel import World
from miles_core.samplers.sampler import sample
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

TOK = CharTokenizer()
CFG = UpdateConfig(num_minibatches=2, row_chunk=3, kl_coef=0.1)
OWN = AdpoSettings(step_fraction=0.5)


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


def _update(batch: TrajectoryBatch, world: World | None = None, cfg: UpdateConfig = CFG):
    model = _model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    stats = update_policy(model, opt, batch, cfg, TOK, 1.0, torch.Generator().manual_seed(1), world=world, own=OWN)
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_world_of_size_one_is_bit_identical_to_no_world() -> None:
    batch = _batch(_model())
    (a, wa), (b, wb) = _update(batch), _update(batch, world=World())
    assert a == b and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ranks_own_equal_blocks_of_whole_groups_and_read_only_the_batches_they_touch() -> None:
    # 7 sampler batches of 4 rows in groups of 2 (14 groups) over 3 ranks: groups 0-4, 5-9, 10-13
    owned = [torch.cat([owned_rows(j, 4, 7, 2, World(r, 3)) for j in range(7)]) for r in range(3)]
    assert [int(o.sum()) for o in owned] == [10, 10, 8] and bool(sum(o.int() for o in owned).eq(1).all())
    for o in owned:  # never a group split between ranks
        assert bool((o.view(-1, 2).all(1) | ~o.view(-1, 2).any(1)).all())
    assert [my_share(7, 4, 2, World(r, 3)) for r in range(3)] == [[0, 1, 2], [2, 3, 4], [5, 6]]
    assert [first_reader(2, 4, 7, 2, World(r, 3)) for r in range(3)] == [True, False, False]
    # fewer batches than ranks: every rank still gets work, each reads one batch
    assert [my_share(1, 8, 2, World(r, 4)) for r in range(4)] == [[0]] * 4
    assert [int(owned_rows(0, 8, 1, 2, World(r, 4)).sum()) for r in range(4)] == [2, 2, 2, 2]
    # fewer groups than ranks (a short last update): the last ranks own none
    assert [int(owned_rows(0, 8, 1, 2, World(r, 5)).sum()) for r in range(5)] == [2, 2, 2, 2, 0]
    with pytest.raises(ValueError, match="not whole units of 3 rows"):
        owned_rows(0, 8, 1, 3, World(0, 2))
    # dealt single trajectories (an estimator that reads no group): 28 over 3 ranks, rows 0-9 /
    # 10-18 / 19-27, so the group of rows 18-19 straddles ranks 1 and 2 and both read batch 4
    one = [torch.cat([owned_rows(j, 4, 7, 1, World(r, 3)) for j in range(7)]) for r in range(3)]
    assert [int(o.sum()) for o in one] == [10, 9, 9] and bool(sum(o.int() for o in one).eq(1).all())
    assert [my_share(7, 4, 1, World(r, 3)) for r in range(3)] == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    assert [first_reader(4, 4, 7, 1, World(r, 3)) for r in range(3)] == [False, True, False]


def test_share_closed_forms_equal_the_row_by_row_deal() -> None:
    """my_share, first_reader and owned_units in closed form against their definitions through
    owned_rows (which batches hold a row the rank owns; the lowest such rank), over every small
    shape, uneven and short ones included."""
    for batches in range(1, 8):
        for n, group in ((2, 1), (2, 2), (4, 2), (6, 3), (8, 2), (12, 4)):
            for d in range(1, 8):
                owned = {r: [owned_rows(j, n, batches, group, World(r, d)) for j in range(batches)] for r in range(d)}
                for r in range(d):
                    world = World(r, d)
                    assert my_share(batches, n, group, world) == [j for j in range(batches) if owned[r][j].any()]
                    groups = sorted({(j * n + i) // group for j in range(batches) for i in range(n) if owned[r][j][i]})
                    assert list(owned_units(batches, n, group, world)) == groups
                    for j in range(batches):
                        lowest = min((q for q in range(d) if owned[q][j].any()), default=None)
                        assert first_reader(j, n, batches, group, world) == (lowest == r), (batches, n, group, d, r, j)


def test_a_deal_by_speed_makes_the_slowest_rank_as_quick_as_whole_groups_allow() -> None:
    # 13 groups at speeds 1 : 3 : 1.2, each to whoever finishes it first: 2, 8, 3 groups, times
    # 2, 2.67, 2.5 (3, 7, 3 would take 3)
    assert cuts(13, 3, [1.0, 3.0, 1.2]) == [0, 2, 10, 13]
    assert cuts(10, 3) == cuts(10, 3, [2.0] * 3) == [0, 4, 7, 10]  # equal speeds: the equal blocks
    assert cuts(5, 3, [0.01, 100.0, 0.01]) == [0, 1, 4, 5]      # far slower ranks keep a group: still measured
    assert cuts(2, 3, [1.0, 2.0, 3.0]) == cuts(2, 3) == [0, 1, 2, 2]  # fewer groups than ranks: as dealt equally
    with pytest.raises(ValueError, match="3 positive numbers"):
        cuts(10, 3, [1.0, 0.0, 1.0])
    gen = torch.Generator().manual_seed(3)
    for _ in range(150):  # against every composition with a group each: none has a quicker slowest rank
        d, units = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(0, 13, (1,), generator=gen))
        sp = (torch.rand(d, generator=gen) * 4 + 0.05).tolist()
        c = cuts(units, d, sp)
        assert c[0] == 0 and c[-1] == units and all(a <= b for a, b in zip(c, c[1:]))
        if units < d:
            continue
        blocks = [c[r + 1] - c[r] for r in range(d)]
        best = min(max(b / s for b, s in zip(comp, sp))
                   for comp in itertools.product(range(1, units + 1), repeat=d) if sum(comp) == units)
        assert min(blocks) >= 1 and max(b / s for b, s in zip(blocks, sp)) <= best + 1e-12, (units, sp, blocks)
    for batches, n, group, d in ((7, 4, 2, 3), (5, 8, 4, 4), (3, 6, 3, 5)):
        sp = [0.5 + r for r in range(d)]
        owned = [torch.cat([owned_rows(j, n, batches, group, World(r, d), sp) for j in range(batches)]) for r in range(d)]
        assert bool(sum(o.int() for o in owned).eq(1).all())  # every row owned once
        for r in range(d):
            world = World(r, d)
            assert my_share(batches, n, group, world, sp) == [j for j in range(batches) if owned[r][j * n:(j + 1) * n].any()]
            for j in range(batches):
                lowest = min((q for q in range(d) if owned[q][j * n:(j + 1) * n].any()), default=None)
                assert first_reader(j, n, batches, group, world, sp) == (lowest == r)


def test_rank_speeds_are_work_rates_smoothed_and_kept_for_a_rank_without_rows() -> None:
    speeds = RankSpeeds(keep=0.5)
    assert speeds.observe(World(), 0, 1.0) is None                    # nothing measured: equal blocks
    assert speeds.observe(World(), 30, 2.0) == [15.0]                 # 30 trajectories in 2 s of its own work
    assert speeds.observe(World(), 10, 2.0) == [0.5 * 15.0 + 0.5 * 5.0]
    assert speeds.observe(World(), 0, 0.0) == [10.0]                  # no rows this update: the old figure


def test_agree_in_one_process_returns_the_verdicts_in_order() -> None:
    assert agree(2, {1: Verdict.dropped(4), 0: Verdict.fresh(0)}, World()) == [Verdict.fresh(0), Verdict.dropped(4)]


def test_trajectory_draws_do_not_depend_on_the_batch_around_them() -> None:
    """A trajectory's rows and minibatch come from (seed, its key): the same alone, in its group,
    or anywhere in a larger batch, which is what lets a rank draw only for its own trajectories."""
    batch = _batch(_model())
    keys = trajectory_keys("batch-7", len(batch))
    whole = Draws(11, keys, batch.group_id)
    rows = build_rows(batch, 0.5, whole)
    part = torch.arange(4, 8)  # the second group alone
    sub_rows = build_rows(batch.select(part), 0.5, whole.select(part))
    mine = (rows.traj >= 4) & (rows.traj < 8)
    assert torch.equal(rows.traj[mine] - 4, sub_rows.traj) and torch.equal(rows.step[mine], sub_rows.step)
    mb_whole = minibatches(rows.traj, whole, 2, epoch=0)
    mb_part = minibatches(sub_rows.traj, whole.select(part), 2, epoch=0)
    at = {int(i): m for m, idx in enumerate(mb_whole) for i in idx}
    assert [at[int(i)] for i in mine.nonzero().squeeze(1)] == [m for i in range(len(sub_rows.traj))
                                                               for m, idx in enumerate(mb_part) if i in idx.tolist()]
    sizes = [len(m) for m in mb_whole]
    assert abs(sizes[0] - sizes[1]) <= 3 and sum(sizes) == rows.traj.numel()  # a group's remainder at most
    assert not torch.equal(build_rows(batch, 0.5, Draws(12, keys)).step, rows.step)  # another update draws anew


def test_a_group_split_between_ranks_deals_its_rows_to_the_one_process_minibatches() -> None:
    """Single trajectories dealt (learner/shares.py): cut anywhere, each piece's rows land in the
    minibatches the whole batch gives them, told the groups' first members' keys and how many of
    their rows the earlier pieces hold (what algo/ranks.py::Ranks.rows_before exchanges)."""
    batch = _batch(_model())
    keys = trajectory_keys("batch-7", len(batch))
    leads = keys[torch.arange(len(batch)) // 4 * 4]
    whole = Draws(11, keys, batch.group_id, leads)
    rows = build_rows(batch, 0.75, whole)                       # 3 rows a trajectory: odd, so the offset matters
    for count in (2, 3):
        at = {int(i): m for m, idx in enumerate(minibatches(rows.traj, whole, count, epoch=1)) for i in idx}
        assert at == {int(i): m for m, idx in enumerate(minibatches(rows.traj, Draws(11, keys, batch.group_id), count, 1))
                      for i in idx}                            # leads given or found: the same for whole groups
        for lo, hi in ((0, 5), (5, 6), (6, 11), (11, 12)):      # groups 0-3, 4-7, 8-11 cut at 5, 6 and 11
            part = torch.arange(lo, hi)
            sub = build_rows(batch.select(part), 0.75, whole.select(part))
            below = torch.tensor([int(((rows.traj < lo) & (rows.traj // 4 == int(t) // 4)).sum()) for t in part])
            got = minibatches(sub.traj, whole.select(part), count, 1, below)
            mine = ((rows.traj >= lo) & (rows.traj < hi)).nonzero().squeeze(1)
            assert [at[int(i)] for i in mine] == [m for i in range(sub.traj.numel()) for m, idx in enumerate(got)
                                                  if i in idx.tolist()], (count, lo, hi)
            if int(below[0]) % count:                            # a straddled group: without the count it differs
                alone = minibatches(sub.traj, whole.select(part), count, 1)
                assert any(not torch.equal(a, b) for a, b in zip(alone, got)), (lo, hi)
