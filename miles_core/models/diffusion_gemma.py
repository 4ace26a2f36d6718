"""DiffusionGemma through transformers' own class: its config, a tiny checkpoint in the published
layout, loading, the decoder-only LoRA targets, and its :data:`FAMILY` record (the forwards the
sampler and the learner share are miles_core/models/canvas.py).

The only module that tells a DiffusionGemma by its type (:func:`is_diffusion_gemma`): everything
else asks the family registry (models/registry.py) for its sampler ``renoise`` and batch kind.

transformers 5.24 ships ``DiffusionGemmaForBlockDiffusion`` (``models/diffusion_gemma/``,
checkpoint google/diffusiongemma-26B-A4B-it). It is not absorbing-mask diffusion: an encoder (the
decoder's own weights, tied) writes the prompt into a KV cache once; a bidirectional decoder reads
it and predicts a whole canvas of ``canvas_length`` tokens that started as uniform random tokens,
with *self-conditioning*: the previous step's tempered logits enter as a soft embedding
``softmax(z) @ E * sqrt(d)`` through a gated MLP (``DiffusionGemmaSelfConditioning``).

LoRA goes on the decoder only (``lora.add_lora`` picks
:data:`DECODER_LORA_TARGETS`): its attention and dense-MLP projections and the self-conditioning MLP. The encoder modules share the base weights but carry no
adapter, so the prompt cache is the frozen base's and is computed once, without a graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_core.config import ConfigError
from miles_core.models import canvas
from miles_core.models.family import Family, LoadOptions
from miles_core.models.hf_tokenizer import load_tokenizer
from miles_core.tokenizer import CharTokenizer

# peft target regex (full match on module names): decoder projections and the self-conditioning MLP.
DECODER_LORA_TARGETS = (r".*decoder\.(layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
                        r"|self_conditioning\.(gate|up|down)_proj)")


def text_only_config(vocab_size: int, pad_id: int, eos_id: int, canvas_length: int, hidden: int = 64,
                     layers: int = 2, heads: int = 4, experts: int = 4, sliding_window: int = 64,
                     head_dim: int | None = None, intermediate: int | None = None, full_every: int = 2) -> Any:
    """A text-only ``DiffusionGemmaConfig`` with the real fields (sliding layers with a full one
    every ``full_every``, the published 5:1 being 6; MoE beside the dense MLP; a 1-layer 16-wide
    vision tower that text never reaches, since the class always builds one). Tests and benchmarks
    use it small; ``benchmarks.gpu_check`` at the published text sizes. Nothing downloads the 26B."""
    from transformers import DiffusionGemmaConfig

    hd = head_dim or hidden // heads
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=hd, global_head_dim=hd, sliding_window=sliding_window, max_position_embeddings=4096,
                pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, num_experts=experts,
                top_k_experts=2, moe_intermediate_size=hidden // 2,
                layer_types=["full_attention" if (i + 1) % full_every == 0 or i == layers - 1 else "sliding_attention"
                             for i in range(layers)])
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=16, position_embedding_size=16,
                  patch_size=4)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length)


def write_tiny_checkpoint(directory: str | Path, tok: Any, canvas_length: int, seed: int = 0, **sizes: int) -> Path:
    """A random-init DiffusionGemma folder in the published layout (``config.json`` with
    ``model_type: diffusion_gemma``, ``model.safetensors``) plus the tokenizer."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    cfg = text_only_config(tok.vocab_size, tok.pad_id, tok.eos_id, canvas_length, **sizes)
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
    if CharTokenizer.saved_in(d):
        tok: Any = CharTokenizer.load(d)
    else:
        tok = load_tokenizer(d, int(model.config.text_config.pad_token_id or 0))
    if tok.vocab_size > model.config.text_config.vocab_size:
        raise ConfigError(f"{d}: the tokenizer has {tok.vocab_size} tokens, the embedding only "
                          f"{model.config.text_config.vocab_size}")
    return model, tok


def is_diffusion_gemma(model: nn.Module) -> bool:
    """A bare ``DiffusionGemmaForBlockDiffusion`` (the registry unwraps peft before asking)."""
    return type(model).__name__ == "DiffusionGemmaForBlockDiffusion"


def smoke(model: nn.Module, tok: Any) -> dict[str, Any]:
    """``miles models check``: no masked forward here, so the prompt encoded and one canvas decoded."""
    width = int(canvas.core(model).config.canvas_length)
    ids = torch.tensor([tok.encode("1+2=")])
    with torch.no_grad():
        enc = canvas.encode(model, ids, torch.ones_like(ids, dtype=torch.bool), width)
        logits = canvas.decode(model, enc, torch.randint(0, tok.vocab_size, (1, width)), None)
    return {"family": "diffusion_gemma", "native": "diffusion_gemma",
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(next(model.parameters()).dtype),
            "eos_id": tok.eos_id, "vocab_size": tok.vocab_size, "canvas_length": width,
            "attention": "causal prompt encoder + bidirectional canvas decoder",
            "smoke_forward": list(logits.shape), "finite": bool(torch.isfinite(logits).all())}


def _load(directory: Path, opts: LoadOptions) -> tuple[nn.Module, Any]:
    return load_diffusion_gemma(directory, dtype=getattr(torch, opts.dtype))


def _init(out: Path, seed: int) -> Path:  # canvas 24: the tiny recipe's completion length
    return write_tiny_checkpoint(out, CharTokenizer(), canvas_length=24, seed=seed, hidden=32, heads=2)


# Renoising, not masked: its own sampler (samplers/renoise.py) records a RenoiseBatch ("renoise").
FAMILY = Family("diffusion_gemma", load=_load, owns=is_diffusion_gemma, lora_targets=lambda m: DECODER_LORA_TARGETS,
                model_types=("diffusion_gemma",), sampler="renoise", batch_kind="renoise", init=_init, smoke=smoke)
