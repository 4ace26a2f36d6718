"""Activation (gradient) checkpointing for any family: recompute each layer in backward instead of
keeping its activations (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

An ADPO update holds one chunk of rows through forward and backward. Without checkpointing its
memory is every layer's activations for the chunk; with it, only each layer's input, at the price
of a second forward per layer. That lets ``update.chunk_tokens`` be larger at real-model sizes.

The families keep their layers in different places (``blocks`` in the tiny model, ``layers`` in
the Llama / Qwen3 wrappers and the transformers classes, encoder and decoder stacks in
DiffusionGemma), so the stacks are found by shape, not by name: every ``nn.ModuleList`` whose
modules share one class, outside any other such list. Each layer's ``forward`` is replaced on the
instance, so module names, state-dict keys and peft's adapter keys do not change, and under
``no_grad`` (sampling, scoring without a graph) the layer runs as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MARK = "_miles_checkpointed"


def layer_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """The model's layer stacks: ModuleLists of modules of one class, none inside another."""
    found: list[nn.ModuleList] = []
    inside: set[int] = set()
    for m in model.modules():  # parents come before their children
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList) and len(m) >= 1 and len({type(c) for c in m}) == 1:
            found.append(m)
            inside.update(id(x) for x in m.modules())
    return found


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute every layer of ``model``'s stacks in backward -> how many layers (idempotent)."""
    n = 0
    for stack in layer_stacks(model):
        for layer in stack:
            n += 1
            if getattr(layer, MARK, False):
                continue
            plain = layer.forward

            def forward(*args: Any, _plain=plain, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return _plain(*args, **kwargs)
                return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

            layer.forward = forward
            setattr(layer, MARK, True)
    return n

