"""The forwards of a renoising canvas model (DiffusionGemma, transformers'
``DiffusionGemmaForBlockDiffusion``) that its sampler (samplers/renoise.py), learner rows
(algo/renoise_rows.py) and SFT (algo/renoise_sft.py) share: encode the prompts once into the KV
cache, decode a canvas under a self-conditioning signal. A shared helper at the bottom of
models/, as window.py is for the masked families, so the samplers above call it and the
DiffusionGemma backend builds on it.

Why a hook for self-conditioning. The decoder takes the previous logits [B, L, V] and folds them to
a soft embedding [B, L, d] itself; at V = 262,144 the logits of every recorded step cannot be kept
for the learner, but the soft embedding can (d = 2304). :func:`soft_embedding` computes exactly the
decoder's own expression, and :func:`decode` hands it in through a forward pre-hook on
``self_conditioning``, so sampling and scoring share one arithmetic (a test checks the sampler
against ``model.generate`` token for token, which passes the logits the decoder's own way).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor, nn


def core(model: nn.Module) -> nn.Module:
    """The ``DiffusionGemmaModel`` inside a (peft-wrapped) ``DiffusionGemmaForBlockDiffusion``: the
    module holding both the prompt encoder and the canvas decoder."""
    for _, m in model.named_modules():
        if isinstance(getattr(m, "encoder", None), nn.Module) and isinstance(getattr(m, "decoder", None), nn.Module):
            return m
    raise TypeError(f"{type(model).__name__} holds no module with an encoder and a decoder (a DiffusionGemmaModel)")


@dataclass
class Prompt:
    """The encoded prompts of a batch: the encoder's KV cache and what the decoder needs with it."""

    cache: Any          # transformers DynamicCache, read-only for the decoder
    attn: Tensor        # [B, P + L] bool: real prompt tokens, then the canvas
    positions: Tensor   # [B, L] long: canvas positions, right after each row's own prompt
    masks: dict         # the decoder's attention masks per layer type


def encode(model: nn.Module, prompt: Tensor, real: Tensor, canvas_length: int, grad: bool = False) -> Prompt:
    """Encode left-padded prompts [B, P] (``real`` [B, P] bool) into the KV cache, once.

    Positions count real tokens only, so a padded row sees the positions it would alone (its
    canvas starts right after its own prompt); with equal lengths this is ``generate``'s arange.
    ``grad``: keep the encoder's graph (full fine-tuning; under LoRA the encoder is frozen)."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return _encode(model, prompt, real, canvas_length)


def _encode(model: nn.Module, prompt: Tensor, real: Tensor, canvas_length: int) -> Prompt:
    from transformers import DynamicCache

    m = core(model)
    cfg = m.config
    cache = DynamicCache(config=cfg.get_text_config(decoder=True))
    pos = (real.long().cumsum(1) - 1).clamp_min(0)                              # [B, P]
    dummy = torch.empty((*prompt.shape, 0), dtype=m.decoder.embed_tokens.weight.dtype, device=prompt.device)
    enc_masks = m.encoder.create_masks_for_generate(config=cfg, inputs_embeds=dummy, attention_mask=real,
                                                       cache=cache, position_ids=pos)
    m.encoder(input_ids=prompt, attention_mask=enc_masks, cache=cache, position_ids=pos)
    attn = torch.nn.functional.pad(real, (0, canvas_length), value=True)        # [B, P + L]
    positions = real.sum(1, keepdim=True) + torch.arange(canvas_length, device=prompt.device)  # [B, L]
    dmasks = m.decoder.create_diffusion_decoder_attention_mask(
        config=cfg, inputs_embeds=torch.empty(prompt.shape[0], canvas_length, 1, device=prompt.device),
        cache=cache, decoder_attention_mask=attn)
    return Prompt(cache, attn, positions, dmasks)


def select(p: Prompt, rows: Tensor) -> Prompt:
    """The encoded prompts of a subset of rows (the cache tensors indexed on the batch axis)."""
    import copy

    cache = copy.copy(p.cache)
    cache.layers = [copy.copy(layer) for layer in p.cache.layers]
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    masks = {k: (v[rows] if isinstance(v, Tensor) else v) for k, v in p.masks.items()}
    return Prompt(cache, p.attn[rows], p.positions[rows], masks)


def soft_embedding(model: nn.Module, z: Tensor) -> Tensor:
    """The self-conditioning input of the next step from this step's tempered logits z [B, L, V]:
    the decoder's own expression (``DiffusionGemmaDecoderModel.forward``), [B, L, d]."""
    emb = core(model).decoder.embed_tokens
    zw = z.to(emb.weight.dtype)   # generate hands the decoder logits cast to the embedding dtype
    return torch.matmul(zw.softmax(dim=-1, dtype=torch.float32).to(emb.weight.dtype), emb.weight) * \
        emb.embed_scale.to(emb.weight.dtype)


@contextlib.contextmanager
def _conditioned(model: nn.Module, soft: Tensor | None) -> Iterator[None]:
    """Substitute ``soft`` [B, L, d] for the decoder's zero self-conditioning input (None: zeros,
    the first step)."""
    if soft is None:
        yield
        return
    sc = core(model).decoder.self_conditioning
    handle = sc.register_forward_pre_hook(lambda _m, args: (args[0], soft.to(args[1].dtype)))
    try:
        yield
    finally:
        handle.remove()


def decode(model: nn.Module, p: Prompt, canvas: Tensor, soft: Tensor | None) -> Tensor:
    """Softcapped decoder logits [B, L, V] float32 of canvases [B, L] given the prompts' cache and
    the self-conditioning input (grad flows when the caller allows it: LoRA is on the decoder)."""
    with _conditioned(model, soft):
        out = model(decoder_input_ids=canvas, cache=p.cache, decoder_attention_mask=p.masks,
                    decoder_position_ids=p.positions)
    return out.logits
