"""Run under torchrun (2 ranks, gloo): one ADPO update through FSDP2 (parallel.shard_model), rank 0
holding 8 of the 12 trajectories and rank 1 four (so rank 1 pads its chunk list), against one
unsharded process on the whole batch. Prints ``max_abs_diff=...`` and the two grad norms on rank 0.
Args: num_minibatches kl_coef."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_parallel import TOK, _batch, _model  # noqa: E402

from miles_core.algo.draws import Draws  # noqa: E402
from miles_core.algo.update import update_policy  # noqa: E402
from miles_core.config import AdpoSettings, UpdateConfig  # noqa: E402
from miles_core.models.lora import adapter_tensors  # noqa: E402
from miles_core.models.window import inner  # noqa: E402
from miles_core.parallel import full_tensors, init_world, shard_model  # noqa: E402

world = init_world("gloo")
cfg = UpdateConfig(num_minibatches=int(sys.argv[1]), row_chunk=3, kl_coef=float(sys.argv[2]), max_grad_norm=1e9)
own = AdpoSettings(step_fraction=0.5)
batch = _batch(_model())
mine = (torch.arange(len(batch)) < 8) == (world.rank == 0)  # whole groups of 4, as learner/shares.py splits


def update(sharded: bool) -> tuple[dict, dict]:
    model = _model()
    if sharded:
        shard_model(inner(model), world, ("window",))  # the denoiser under peft; its window is a forward
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    if sharded:  # this rank's share only, its trajectories keyed as in the whole batch
        idx = mine.nonzero().squeeze(1)
        stats = update_policy(model, opt, batch.select(idx), cfg, TOK, 1.0, Draws(7, torch.arange(len(batch))[idx]),
                              world=world, own=own)
    else:
        stats = update_policy(model, opt, batch, cfg, TOK, 1.0, Draws(7, torch.arange(len(batch))), own=own)
    return stats, {k: v.detach().clone() for k, v in full_tensors(adapter_tensors(model)).items()}


s_sharded, w_sharded = update(True)
world.sharded = False
s_one, w_one = update(False)
if world.rank == 0:
    diff = max(float((w_one[k] - w_sharded[k]).abs().max()) for k in w_one)
    moved = max(float(v.abs().max()) for k, v in w_one.items() if "lora_B" in k)
    print(f"max_abs_diff={diff:.3e} moved={moved:.3e} grad_norm={s_one['grad_norm']:.6f},{s_sharded['grad_norm']:.6f} "
          f"tokens={s_one['tokens']:.0f},{s_sharded['tokens']:.0f}", flush=True)
