"""Denoiser FLOP accounting: measured with ``torch.utils.flop_counter`` and an analytic count
that a test checks against it. NSD's claim is about compute, so compute is what we count."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_SDPA_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _attn_flops(q_shape, k_shape) -> int:
    b, h, t, d = q_shape
    s = k_shape[-2]
    return 4 * b * h * t * s * d  # Q K^T and P V, 2 FLOPs per multiply-add


if _CPU_SDPA.default not in torch.utils.flop_counter.flop_registry:
    # torch counts SDPA on CUDA but not the CPU flash kernel; without this, attention is invisible
    @register_flop_formula(_CPU_SDPA)
    def _sdpa_cpu_flop(query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
        return _attn_flops(query_shape, key_shape)

    @register_flop_formula(_CPU_SDPA_BWD)
    def _sdpa_cpu_bwd_flop(grad_out_shape, query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * _attn_flops(query_shape, key_shape)  # dQ, dK, dV, dP: twice the forward


@dataclass
class FlopMeter:
    """Accumulates FLOPs per phase (e.g. "sample", "update") across many measured blocks."""

    totals: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        counter = FlopCounterMode(display=False)
        with counter:
            yield
        self.totals[phase] = self.totals.get(phase, 0) + int(counter.get_total_flops())

    @property
    def total(self) -> int:
        return sum(self.totals.values())


def tiny_forward_flops(d_model: int, n_layers: int, d_ff: int, vocab: int, batch: int, seq_len: int,
                       head_positions: int | None = None) -> int:
    """Analytic forward FLOPs of TinyDenoiser on [batch, seq_len] (2 per multiply-add).

    Per layer: q,k,v,o projections 4*2*T*D*D, MLP 2*2*T*D*F, attention scores and weighted sum
    2*2*T*T*D; plus the LM head 2*H*D*V over the H = ``head_positions`` positions whose logits are
    asked for (default all T; a sampler step asks for its block only). Layer norms, GELU and
    softmax are not matmuls and FlopCounterMode does not count them either.
    """
    t, d = seq_len, d_model
    h = t if head_positions is None else head_positions
    per_layer = 8 * t * d * d + 4 * t * d * d_ff + 4 * t * t * d
    return batch * (n_layers * per_layer + 2 * h * d * vocab)
