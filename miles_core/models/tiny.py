"""A small bidirectional transformer denoiser for absorbing-state ([MASK]) diffusion.

No causal mask: every position sees every other (prompt and completion), as in LLaDA/MDLM.
Learned absolute positions are right-aligned (the sequence ends at ``max_len - 1``): the
fixed-length completion always sits at the same positions, and a left-padded row is scored exactly
as it would be alone (tests/test_core_train.py).
Linear layers are named q_proj/k_proj/v_proj/o_proj/fc1/fc2 so peft LoRA targets them the same
way it targets a Llama backbone.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from miles_core.models import modeling_miles_tiny as published
from miles_core.models.checkpoint import load_module, save_module
from miles_core.models.family import Family, LoadOptions
from miles_core.models.modeling_miles_tiny import Block, init_weights, padding_bias, right_aligned_positions
from miles_core.models.window import (Capabilities, KVCache, Out, Span, WindowDenoiser, head_weight_of, key_mask,
                                      kept_spans, out_logits)
from miles_core.tokenizer import CharTokenizer


@dataclass
class TinyConfig:
    vocab_size: int
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    max_len: int = 96
    model_type: str = "miles-tiny"

    def to_dict(self) -> dict:  # peft reads model.config.to_dict()
        return asdict(self)

    def get(self, key: str, default=None):  # peft sometimes calls config.get(...)
        return getattr(self, key, default)


class TinyDenoiser(WindowDenoiser):
    """logits = model(input_ids [B, T], attention_mask [B, T] bool) -> [B, T, V]."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.d_ff) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(init_weights)

    def capabilities(self) -> Capabilities:
        c = self.config
        return Capabilities(kv_cache=True, head_weight=head_weight_of(c.vocab_size, c.d_model, c.n_layers, c.d_ff))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        t = input_ids.shape[1]
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return self.window(input_ids, mask, (0, t), (0, t))[0].to(input_ids.device)         # [B, T, V]

    def window(self, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None = None,
               keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
        """miles_core/models/window.py: logits of ``out`` from a pass over ``query`` attending to ``cache`` too."""
        dev = self.lm_head.weight.device  # samplers may hand CPU tensors to a model on a GPU
        ids, mask = ids.to(dev), mask.to(dev).bool()
        b, total = ids.shape
        q0, q1 = query
        # right-aligned positions (modeling_miles_tiny.right_aligned_positions): the completion sits at
        # the same positions whatever the prompt's length, and a left-padded row gets exactly the
        # positions it would get alone (the pad width its batch's longest prompt sets does not move
        # it; measured on the code task, where one 28-character prompt made a whole RL batch decode empty)
        pos = right_aligned_positions(q0, q1, total, self.config.max_len, dev)           # [Tq]
        h = self.tok_emb(ids[:, q0:q1]) + self.pos_emb(pos)[None]
        _, kreal = key_mask(mask, query, cache)                                         # [B, Tk]
        bias = padding_bias(kreal, h.dtype)                                             # padded keys: -inf
        kvs = []
        for i, blk in enumerate(self.blocks):
            h, kv = blk(h, bias, cache.layers[i] if cache is not None else None)
            kvs.append(kv)
        new = kept_spans(kvs, keep, q0) if keep else None
        return out_logits(lambda x: self.lm_head(self.ln_f(x)), h, mask, query, out), new   # [B, n, V]

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors, and the remote code transformers opens them with
        (``AutoModel.from_pretrained(directory, trust_remote_code=True)``: modeling_miles_tiny.py)."""
        code = Path(published.__file__)
        save_module(self, {**self.config.to_dict(), "architectures": ["MilesTinyModel"],
                           "auto_map": {k: f"{code.stem}.{v}" for k, v in AUTO_MAP.items()}}, directory)
        shutil.copyfile(code, Path(directory) / code.name)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "TinyDenoiser":
        names = {f.name for f in fields(TinyConfig)}
        return load_module(directory, "miles-tiny", lambda cfg: cls(TinyConfig(**{k: cfg[k] for k in names if k in cfg})))


# the classes a folder's config.json names for transformers' Auto classes (modeling_miles_tiny.py)
AUTO_MAP = {"AutoConfig": "MilesTinyConfig", "AutoModel": "MilesTinyModel", "AutoModelForMaskedLM": "MilesTinyModel"}

# peft targets: the attention and MLP projections, named as a Llama's are
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")


def _load(directory: Path, opts: LoadOptions) -> tuple[nn.Module, CharTokenizer]:
    return TinyDenoiser.from_pretrained(directory), CharTokenizer.load(directory)


def init_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """A random-init tiny checkpoint with the character tokenizer (``models init --family tiny``)."""
    torch.manual_seed(seed)
    tok = CharTokenizer()
    TinyDenoiser(TinyConfig(tok.vocab_size, 32, 1, 2, 64, 64)).save_pretrained(out)
    tok.save(out)
    return Path(out)


# Miles' own character model (config.json model_type "miles-tiny").
FAMILY = Family("tiny", load=_load, owns=lambda m: isinstance(m, TinyDenoiser), lora_targets=lambda m: LORA_TARGETS,
                model_types=("miles-tiny",), init=init_checkpoint)
