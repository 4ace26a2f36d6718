"""Helpers every transformers-backed family shares (the bidirectional Llama of models/llama.py
and the published families of models/hf.py): switching a native causal LM to bidirectional
attention, real-token positions, quiet loading, and the projection names LoRA adapts.

Why a module of its own: below every backend, these make none of them import another (models/hf.py
taking them from models/llama.py would close a circle through models/lora.py and the
DiffusionGemma module back to models/hf.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

# Attention and MLP projections LoRA adapts, keyed by the native transformers model_type.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "modernbert": ("Wqkv", "Wo", "Wi"),
}


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No per-shard progress bars while loading/saving tiny checkpoints (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def make_bidirectional(lm: nn.Module) -> int:
    """Turn off causal attention in config and in every attention module; return how many modules."""
    lm.config.is_causal = False
    n = 0
    for m in lm.modules():
        if hasattr(m, "is_causal") and isinstance(m.is_causal, bool):
            m.is_causal = False
            n += 1
    if n == 0:
        raise ValueError("make_bidirectional: found no attention module with an `is_causal` flag; "
                         "this transformers version builds Llama attention differently")
    return n


def model_inputs(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(ids, bool mask, positions) on ``lm``'s device. Positions count real tokens only
    (``cumsum(mask) - 1``), so left padding never shifts a row's rotary positions."""
    dev = lm.get_input_embeddings().weight.device
    ids = input_ids.to(dev)
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(dev).bool()
    return ids, mask, (mask.long().cumsum(1) - 1).clamp_min(0)                          # [B, T] each
