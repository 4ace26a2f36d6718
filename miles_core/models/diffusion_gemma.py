"""DiffusionGemma through transformers' own class: loading, decoder-only LoRA, and the two forwards
the renoising sampler (samplers/renoise.py) and its learner (algo/renoise_rows.py) share.

transformers 5.24 ships ``DiffusionGemmaForBlockDiffusion`` (``models/diffusion_gemma/``,
checkpoint google/diffusiongemma-26B-A4B-it). It is not absorbing-mask diffusion: an encoder (the
decoder's own weights, tied) writes the prompt into a KV cache once; a bidirectional decoder reads
it and predicts a whole canvas of ``canvas_length`` tokens that started as uniform random tokens,
with *self-conditioning*: the previous step's tempered logits enter as a soft embedding
``softmax(z) @ E * sqrt(d)`` through a gated MLP (``DiffusionGemmaSelfConditioning``).

Why a hook for self-conditioning. The decoder takes the previous logits [B, L, V] and folds them to
a soft embedding [B, L, d] itself; at V = 262,144 the logits of every recorded step cannot be kept
for the learner, but the soft embedding can (d = 2304). :func:`soft_embedding` computes exactly the
decoder's own expression, and :func:`decode` hands it in through a forward pre-hook on
``self_conditioning``, so sampling and scoring share one arithmetic (a test checks the sampler
against ``model.generate`` token for token, which passes the logits the decoder's own way).

LoRA goes on the decoder only (issue: "LoRA on the decoder"; ``lora.add_lora`` picks
:data:`DECODER_LORA_TARGETS`): its attention and dense-MLP projections and the self-conditioning MLP. The encoder modules share the base weights but carry no
adapter, so the prompt cache is the frozen base's and is computed once, without a graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from miles_core.config import ConfigError

# peft target regex (full match on module names): decoder projections and the self-conditioning MLP.
DECODER_LORA_TARGETS = (r".*decoder\.(layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
                        r"|self_conditioning\.(gate|up|down)_proj)")


def tiny_config(vocab_size: int, pad_id: int, eos_id: int, canvas_length: int, hidden: int = 64,
                layers: int = 2, heads: int = 4, experts: int = 4, sliding_window: int = 64) -> Any:
    """A text-only ``DiffusionGemmaConfig`` with the real fields (alternating sliding / full layers,
    MoE beside the dense MLP, a 1-layer 16-wide vision tower that text never reaches, since the
    class always builds one). Used by tests and benchmarks: nothing here can download the 26B."""
    from transformers import DiffusionGemmaConfig

    head_dim = hidden // heads
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                global_head_dim=head_dim, sliding_window=sliding_window, max_position_embeddings=512,
                pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, num_experts=experts,
                top_k_experts=2, moe_intermediate_size=hidden // 2,
                layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=16, position_embedding_size=16,
                  patch_size=4)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length)


def write_tiny_checkpoint(directory: str | Path, tok: Any, canvas_length: int, seed: int = 0, **sizes: int) -> Path:
    """A random-init DiffusionGemma folder in the published layout (``config.json`` with
    ``model_type: diffusion_gemma``, ``model.safetensors``) plus the tokenizer."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    cfg = tiny_config(tok.vocab_size, tok.pad_id, tok.eos_id, canvas_length, **sizes)
    model = DiffusionGemmaForBlockDiffusion(cfg)
    d = Path(directory)
    model.save_pretrained(d)
    tok.save(d)
    return d


def load_diffusion_gemma(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """A local DiffusionGemma folder: the native class and the folder's tokenizer (a Miles char
    tokenizer, or the published Gemma tokenizer, whose pad stands in for the unused mask id)."""
    import json

    from transformers import DiffusionGemmaForBlockDiffusion

    d = Path(directory)
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"checkpoint folder {d} has no config.json")
    mt = json.loads(cfg_file.read_text()).get("model_type")
    if mt != "diffusion_gemma":
        raise ConfigError(f"{cfg_file}: model_type is {mt!r}, the diffusion_gemma family needs 'diffusion_gemma'")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(d), dtype=dtype, local_files_only=True).eval()
    tok_file = d / "tokenizer.json"
    if tok_file.exists() and json.loads(tok_file.read_text()).get("type") == "char":
        from miles_core.tokenizer import CharTokenizer

        tok: Any = CharTokenizer.load(d)
    else:
        from miles_core.models.hf import load_tokenizer

        tok = load_tokenizer(d, int(model.config.text_config.pad_token_id or 0))
    if tok.vocab_size > model.config.text_config.vocab_size:
        raise ConfigError(f"{d}: the tokenizer has {tok.vocab_size} tokens, the embedding only "
                          f"{model.config.text_config.vocab_size}")
    return model, tok


def is_renoising(model: nn.Module) -> bool:
    """A DiffusionGemma (bare or under peft): it samples with samplers/renoise.py, not the masked sampler."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__ == "DiffusionGemmaForBlockDiffusion"


def _core(model: nn.Module) -> nn.Module:
    """The ``DiffusionGemmaModel`` inside a (peft-wrapped) ``DiffusionGemmaForBlockDiffusion``."""
    for _, m in model.named_modules():
        if type(m).__name__ == "DiffusionGemmaModel":
            return m
    raise TypeError(f"{type(model).__name__} holds no DiffusionGemmaModel")


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

    core = _core(model)
    cfg = core.config
    cache = DynamicCache(config=cfg.get_text_config(decoder=True))
    pos = (real.long().cumsum(1) - 1).clamp_min(0)                              # [B, P]
    dummy = torch.empty((*prompt.shape, 0), dtype=core.decoder.embed_tokens.weight.dtype, device=prompt.device)
    enc_masks = core.encoder.create_masks_for_generate(config=cfg, inputs_embeds=dummy, attention_mask=real,
                                                       cache=cache, position_ids=pos)
    core.encoder(input_ids=prompt, attention_mask=enc_masks, cache=cache, position_ids=pos)
    attn = torch.nn.functional.pad(real, (0, canvas_length), value=True)        # [B, P + L]
    positions = real.sum(1, keepdim=True) + torch.arange(canvas_length, device=prompt.device)  # [B, L]
    dmasks = core.decoder.create_diffusion_decoder_attention_mask(
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
    emb = _core(model).decoder.embed_tokens
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
    sc = _core(model).decoder.self_conditioning
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
