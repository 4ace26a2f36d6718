"""The calibrated compute stand-in of benchmarks/emulate.py: the real sampler and learner processes
(``python -m miles_core.asyncrl``) with the model's compute replaced by waits that last what
LLaDA-8B's would, scaled down by one stated constant.

    python -m benchmarks.standin sampler|learner RUN_URI [asyncrl options]   (what emulate.py starts)

What is replaced, in this process only (never in the product path): the tiny model the run's
recipe names gets (1) a forward hook on its last block that waits, per sampling step, the rollout's
share of LLaDA-8B's rollout time, and per scored update row the update's share (a third in the
forward, two thirds in the backward through a gradient hook), and (2) a ``ballast`` projection no
forward uses, whose LoRA factors make the adapter as large as LLaDA-8B's r=64 adapter: published,
fetched by every sampler and all-reduced every optimizer step, so the transfers are real too.
Times and bytes are LLaDA-8B's (benchmarks/scale_model.py::llada_8b) times ``SCALE``; the settings
travel in the environment (``MILES_STANDIN``, JSON), which emulate.py sets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

SCALE = 1 / 32  # one constant for both: seconds and bytes are LLaDA-8B's times this


def settings(batch_completions: int, steps: int, step_fraction: float) -> dict[str, Any]:
    """The stand-in's waits and ballast for a run whose sampler batches hold ``batch_completions``
    completions sampled in ``steps`` steps, ADPO scoring ``step_fraction`` of them."""
    from benchmarks.scale_model import llada_8b

    real = llada_8b()
    rows = batch_completions * steps * step_fraction  # scored rows per sampler batch (ADPO)
    return {"step_s": SCALE * real.rollout_s / steps, "row_s": SCALE * real.update_s / rows,
            "rollout_s": SCALE * real.rollout_s, "update_s": SCALE * real.update_s,
            "adapter_bytes": SCALE * real.adapter_bytes, "allreduce_bytes": SCALE * real.allreduce_bytes}


class _Wait:
    """The last block's forward hook (every pass runs it, whichever logits it then computes): a
    sampling step waits ``step_s``; with gradients on, a chunk of R scored rows waits R x row_s / 3
    now and 2 R x row_s / 3 in its backward."""

    def __init__(self, step_s: float, row_s: float) -> None:
        self.step_s, self.row_s = step_s, row_s

    def __call__(self, module: nn.Module, args: Any, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out  # [R, T, d]
        if not torch.is_grad_enabled():
            time.sleep(self.step_s)
            return out
        rows = h.shape[0]
        time.sleep(rows * self.row_s / 3)
        back = 2 * rows * self.row_s / 3
        if h.requires_grad:
            h.register_hook(lambda g: (time.sleep(back), g)[1])
        return out


def fit(model: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    """Add the ballast projection (its LoRA carries the adapter's bytes) and the waits."""
    ballast_out = max(1, int(cfg["adapter_bytes"] / 2 / cfg["lora_r"]))  # bf16 B factor [out, r]
    model.ballast = nn.Linear(1, ballast_out, bias=False)
    nn.init.zeros_(model.ballast.weight)
    model.blocks[-1].register_forward_hook(_Wait(cfg["step_s"], cfg["row_s"]))
    return model


def install() -> None:
    """Wrap the base loader the sampler and the learner call, in this process."""
    cfg = json.loads(os.environ["MILES_STANDIN"])
    import miles_core.asyncrl.sampler as sampler_mod
    import miles_core.learner.policy as policy_mod

    for mod in (sampler_mod, policy_mod):
        real = mod.load_base
        if getattr(real, "standin", False):
            continue  # installed already (the forkserver imports this module with the flag set)

        def load_base(recipe: Any, base_dir: Any, _real: Any = real) -> Any:
            model, tok = _real(recipe, base_dir)
            return fit(model, cfg), tok
        load_base.standin = True  # type: ignore[attr-defined]
        mod.load_base = load_base


if os.environ.get("MILES_STANDIN_INSTALL") == "1":  # emulate.py's forkserver: every forked sampler has it
    install()

if __name__ == "__main__":
    install()
    from miles_core.asyncrl.__main__ import main

    sys.exit(main(sys.argv[1:]))
