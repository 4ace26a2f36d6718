"""The calibrated compute stand-in of benchmarks/scale/emulate.py: the real sampler and learner processes
(``python -m miles_core.asyncrl``) with the model's compute replaced by waits that last what
LLaDA-8B's would, scaled down by one stated constant.

    python -m benchmarks.standin sampler|learner RUN_URI [asyncrl options]   (what emulate.py starts)

What is replaced, in this process only (never in the product path): the tiny model the run's
recipe names gets (1) waits that last what LLaDA-8B's passes would: a sampling step the rollout's
share of LLaDA-8B's rollout time, a chunk of scored update rows the update's share (a third in the
forward, two thirds in the backward); and (2) a ``ballast`` projection no forward uses, whose
LoRA factors make the adapter as large as LLaDA-8B's r=64 adapter, published and fetched by
every sampler, so the store's transfers are real too. Times and bytes are LLaDA-8B's
(benchmarks/scale/scale_model.py::llada_8b) times ``SCALE``; the settings travel in the environment
(``MILES_STANDIN``, JSON), which emulate.py sets.

The waits are the device's time, not added to the host's: a pass lasts max(host work, its wait)
from its start, as a GPU's queued kernels overlap the Python that launched them. The ballast is
not trained, so the gradient all-reduce carries the tiny model's own LoRA: at LLaDA-8B shape the
all-reduce is ~3e-4 of an update (672 MB of float32 gradients at 40 GB/s against ~100 s of
compute), and gloo across dozens of ranks on 2 shared cores costs more than that at any size, so
the smallest real all-reduce is the closest this machine gets to the real ratio (its latency is
this machine's floor, reported by emulate.py as measured against planned update seconds).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import torch
from torch import nn

SCALE = 1 / 8  # one constant for both: seconds and bytes are LLaDA-8B's times this


def settings(batch_completions: int, steps: int, step_fraction: float, scale: float = SCALE,
             minibatches: int = 1, bytes_scale: float | None = None) -> dict[str, Any]:
    """The stand-in's waits and ballast for a run whose sampler batches hold ``batch_completions``
    completions sampled in ``steps`` steps, ADPO scoring ``step_fraction`` of them in
    ``minibatches`` optimizer steps; LLaDA-8B's seconds and bytes times ``scale`` (the bytes times
    ``bytes_scale`` when given: every process holds an adapter-sized ballast, so a longer time
    scale with the bytes it implies may not fit the machine's memory). ``row_fwd_s``
    is one row's forward: an update's row costs a forward and a backward (3 forwards), and all
    but the first minibatch's rows one more no-grad forward for the proximal policy
    (scale_model.update_passes)."""
    from benchmarks.scale_model import llada_8b, update_passes

    real = llada_8b()
    rows = batch_completions * steps * step_fraction  # scored rows per sampler batch (ADPO)
    return {"step_s": scale * real.rollout_s / steps, "row_fwd_s": scale * real.update_s / rows / update_passes(minibatches),
            "rollout_s": scale * real.rollout_s, "update_s": scale * real.update_s,
            "adapter_bytes": (scale if bytes_scale is None else bytes_scale) * real.adapter_bytes, "scale": scale,
            "bytes_scale": scale if bytes_scale is None else bytes_scale}


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def in_tail(worker: str, seq: int, p: float) -> bool:
    """Whether batch ``seq`` of ``worker`` is a tail rollout (probability ``p``, drawn from
    (worker, seq): a retried batch takes as long again, and a prediction can know the draws)."""
    return p > 0 and random.Random(f"{worker}-{seq}").random() < p


class _Tail:
    """A heavy-tailed rollout (emulate.py's ``--rollout-tail P:X``, the scale model's
    ``rollout_tail_p``/``_x``): a batch :func:`in_tail` takes X times as long."""

    factor = 1.0

    @classmethod
    def draw(cls, cfg: dict[str, Any], worker: str, seq: int) -> None:
        p, x = cfg.get("rollout_tail", (0.0, 1.0))
        cls.factor = x if in_tail(worker, seq, p) else 1.0


class _Wait:
    """Hooks on the first and last blocks (every pass runs both, whichever logits it then
    computes). In a sampler a pass is a sampling step, which ends ``step_s`` after its first
    block began. In the learner a chunk of R scored rows ends its forward R x ``row_fwd_s`` after
    it began (a no-grad pass, the proximal policy's, ends there) and its backward (when the
    gradient reaches the first block's output) 2 R x ``row_fwd_s`` after its forward ended. Host
    work inside those spans overlaps the wait instead of adding to it."""

    def __init__(self, step_s: float, row_fwd_s: float, learner: bool) -> None:
        self.step_s, self.row_fwd_s, self.learner = step_s, row_fwd_s, learner
        self.t0 = 0.0
        self.first: torch.Tensor | None = None

    def start(self, module: nn.Module, args: Any) -> None:
        self.t0, self.first = time.perf_counter(), None

    def first_out(self, module: nn.Module, args: Any, out: Any) -> None:
        h = out[0] if isinstance(out, tuple) else out  # [R, T, d]
        self.first = h if h.requires_grad else None

    def __call__(self, module: nn.Module, args: Any, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out  # [R, T, d]
        if not self.learner:
            _sleep_until(self.t0 + self.step_s * _Tail.factor)
            return out
        rows = h.shape[0]
        _sleep_until(self.t0 + rows * self.row_fwd_s)
        if not torch.is_grad_enabled():
            return out
        back, first = 2 * rows * self.row_fwd_s, self.first if self.first is not None else h
        if first.requires_grad:
            t1 = time.perf_counter()
            first.register_hook(lambda g: (_sleep_until(t1 + back), g)[1])
        return out


def rank_factor(cfg: dict[str, Any]) -> float:
    """This learner rank's persistent slowness (``rank_slowness``, one per rank, emulate.py's
    ``--slow-rank`` / ``--rank-spread``: a GPU slower than the others all run long); 1 without."""
    slow = cfg.get("rank_slowness") or []
    rank = int(os.environ.get("RANK", "0"))
    return float(slow[rank]) if rank < len(slow) else 1.0


def fit(model: nn.Module, cfg: dict[str, Any], learner: bool = False) -> nn.Module:
    """Add the ballast projection (its LoRA carries the adapter's bytes) and the waits (a
    learner's passes are rows, at this rank's slowness; a sampler's are sampling steps)."""
    ballast_out = max(1, int(cfg["adapter_bytes"] / 2 / cfg["lora_r"]))  # bf16 B factor [out, r]
    model.ballast = nn.Linear(1, ballast_out, bias=False)
    nn.init.zeros_(model.ballast.weight)
    wait = _Wait(cfg["step_s"], cfg["row_fwd_s"] * (rank_factor(cfg) if learner else 1.0), learner)
    model.blocks[0].register_forward_pre_hook(wait.start)
    model.blocks[0].register_forward_hook(wait.first_out)
    model.blocks[-1].register_forward_hook(wait)
    return model


def _ballast_frozen(model: nn.Module) -> nn.Module:
    """The ballast's LoRA factors are published and fetched, never trained nor all-reduced."""
    for name, p in model.named_parameters():
        if "ballast" in name:
            p.requires_grad_(False)
    return model


def install() -> None:
    """Wrap the policy builder the sampler and the learner call (learner/policy.py::build_policy), in
    this process: the base it loads gets the ballast and the waits (the learner's, trainable, waits
    per row; a sampler's per step), and the ballast's LoRA factors stay frozen."""
    cfg = json.loads(os.environ["MILES_STANDIN"])
    import miles_core.asyncrl.sampler as sampler_mod
    import miles_core.learner.policy as policy_mod

    real = policy_mod.build_policy
    if getattr(real, "standin", False):
        return  # installed already (the forkserver imports this module with the flag set)

    def build_policy(recipe: Any, base_dir: Any, adapter_dir: Any = None, trainable: bool = True) -> Any:
        load = policy_mod.load_base
        policy_mod.load_base = lambda r, b: (lambda mt: (fit(mt[0], cfg, trainable), mt[1]))(load(r, b))
        try:
            model, tok = real(recipe, base_dir, adapter_dir, trainable)
        finally:
            policy_mod.load_base = load
        return _ballast_frozen(model), tok
    build_policy.standin = True  # type: ignore[attr-defined]
    policy_mod.build_policy = sampler_mod.build_policy = build_policy
    make_batch = sampler_mod.SamplerWorker.make_batch

    def tailed(self: Any, seq: int) -> Any:
        _Tail.draw(cfg, self.worker, seq)
        return make_batch(self, seq)
    sampler_mod.SamplerWorker.make_batch = tailed  # type: ignore[method-assign]


if os.environ.get("MILES_STANDIN_INSTALL") == "1":  # emulate.py's forkserver: every forked sampler has it
    install()

if __name__ == "__main__":
    install()
    from miles_core.asyncrl.__main__ import main

    sys.exit(main(sys.argv[1:]))
