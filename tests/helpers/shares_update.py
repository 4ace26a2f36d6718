"""Run under torchrun (D ranks, gloo): a global batch of B sampler batches, each rank updating on
its own share only (learner/shares.py::owned_rows: single trajectories, so groups straddle ranks,
or whole groups for an estimator that reads them; uneven when D does not divide them), against
one process updating on the whole batch, for several estimators. Rank 0 prints
one ``estimator=... max_abs_diff=... moved=...`` line each, and every rank prints how many
trajectories it passed to the row builder (``built=rank:count``), which must be its share.
Args: D-independent sizes: sampler batches B, groups per batch; optionally the ranks' speeds,
comma-separated (``async_rl.deal = "speed"``: blocks in proportion to them)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_parallel import TOK, _model  # noqa: E402

import miles_core.algo.estimators.adpo as adpo_module  # noqa: E402
from miles_core.algo.advantages import group_advantages  # noqa: E402
from miles_core.algo.draws import Draws, trajectory_keys  # noqa: E402
from miles_core.algo.update import update_policy  # noqa: E402
from miles_core.config import SamplerConfig  # noqa: E402
from tests.helpers.update_cfg import update_and_own  # noqa: E402
from miles_core.learner.shares import deal_unit, owned_rows  # noqa: E402
from miles_core.parallel import init_world  # noqa: E402
from miles_core.samplers.sampler import sample  # noqa: E402
from miles_core.types import TrajectoryBatch  # noqa: E402

world = init_world("gloo")
B, groups, G = int(sys.argv[1]), int(sys.argv[2]), 4
speeds = [float(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
n = groups * G
texts = ["1+2", "3*45", "7-1", "12+9", "8*8", "5-3"]


def sampler_batch(j: int) -> TrajectoryBatch:
    prompts = [TOK.encode(texts[(j + g) % len(texts)]) for g in range(groups) for _ in range(G)]
    b = sample(_model(), TOK, prompts, SamplerConfig(steps=4), 8, torch.Generator().manual_seed(j),
               torch.arange(groups).repeat_interleave(G) + 100 * j)
    b.reward = torch.rand(n, generator=torch.Generator().manual_seed(50 + j)).round()
    b.reward[:G] = 1.0  # a group with no spread: no advantage, its rows are skipped
    b.reward.view(groups, G)[1:, :2] = torch.tensor([0.0, 1.0])  # every other group has a spread
    b.advantage = group_advantages(b.reward, b.group_id)
    return b


batches = [sampler_batch(j) for j in range(B)]
keys = [trajectory_keys(f"b{j}", n) for j in range(B)]
leads = [k[torch.arange(n) // G * G] for k in keys]  # each trajectory's group's first member's key
built: list[int] = []
real_build = adpo_module.build_rows
adpo_module.build_rows = lambda batch, *a, **k: built.append(len(batch)) or real_build(batch, *a, **k)

for estimator in ("adpo", "espo", "wd1"):
    cfg, own = update_and_own(estimator, draws=2, num_minibatches=3, epochs=2, row_chunk=3, kl_coef=0.1,
                              max_grad_norm=1e9, where_declared={"step_fraction": 0.5})

    unit = deal_unit(G, estimator)  # what the learner runtime deals

    def update(mine: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        model = _model()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        if mine is None:  # one process, the whole global batch
            local, k, lead = TrajectoryBatch.concat(batches), torch.cat(keys), None
        else:
            idx = [m.nonzero().squeeze(1) for m in mine]
            held = [b.select(i) for b, i in zip(batches, idx) if i.numel()]
            local = TrajectoryBatch.concat(held) if held else TrajectoryBatch.empty(batches[0].completion_len)
            k = torch.cat([kk[i] for kk, i in zip(keys, idx)])
            lead = torch.cat([ll[i] for ll, i in zip(leads, idx)])
        update_policy(model, opt, local, cfg, TOK, 1.0, Draws(2026, k.long(), leads=lead),
                      world=world if mine is not None else None, own=own)
        return {name: v.detach().clone() for name, v in model.state_dict().items() if "lora_" in name}

    built.clear()
    shares = update([owned_rows(j, n, B, unit, world, speeds) for j in range(B)])
    mine_built = sum(built)
    one = update(None)
    if estimator == "adpo":
        held = sum(int(owned_rows(j, n, B, unit, world, speeds).sum()) for j in range(B))
        print(f"built={world.rank}:{mine_built}:{held}\n", end="", flush=True)  # one write: ranks share stdout, unbuffered under PYTHONUNBUFFERED
    if world.rank == 0:
        diff = max(float((one[k] - shares[k]).abs().max()) for k in one)
        moved = max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k)
        print(f"estimator={estimator} max_abs_diff={diff:.3e} moved={moved:.3e}\n", end="", flush=True)
