"""A small bidirectional transformer denoiser for absorbing-state ([MASK]) diffusion.

No causal mask: every position sees every other (prompt and completion), as in LLaDA/MDLM.
Learned absolute positions are right-aligned (the sequence ends at ``max_len - 1``): the
fixed-length completion always sits at the same positions, and a left-padded row is scored exactly
as it would be alone (tests/test_core_train.py).
Linear layers are named q_proj/k_proj/v_proj/o_proj/fc1/fc2 so peft LoRA targets them the same
way it targets a Llama backbone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles_core.models.checkpoint import load_module, save_module


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


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, h: Tensor, attn_bias: Tensor | None,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """h [B, T, D] -> (h', (k, v) of these T positions, each [B, H, T, D/H]).

        With ``past`` (cached keys/values of earlier positions) the queries attend to past + own.
        """
        b, t, d = h.shape
        x = self.ln1(h)
        q, k, v = (p(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
        a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_bias)
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)))), (k, v)


@dataclass
class PrefixCache:
    """Keys/values of positions [0, length) for every layer: [B, H, length, D/H] each.

    Approximate by design (Fast-dLLM's prefix cache): in a bidirectional model the prefix's
    keys would change as later positions get unmasked; the cache freezes them as they were when
    it was built (at the start of a block). Exact only while the suffix is unchanged.
    """

    length: int
    kv: list[tuple[Tensor, Tensor]]

    def select(self, idx: Tensor) -> "PrefixCache":
        idx = idx.to(self.kv[0][0].device) if self.kv else idx  # the sampler's row mask lives on the CPU
        return PrefixCache(self.length, [(k[idx], v[idx]) for k, v in self.kv])


class TinyDenoiser(nn.Module):
    """logits = model(input_ids [B, T], attention_mask [B, T] bool) -> [B, T, V]."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def _bias(self, attention_mask: Tensor | None, b: int, dtype: torch.dtype) -> Tensor | None:
        if attention_mask is None:
            return None
        # [B, 1, 1, S]: padded keys get -inf, every query still sees all real tokens
        bias = torch.zeros(b, 1, 1, attention_mask.shape[1], dtype=dtype, device=attention_mask.device)
        return bias.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.forward_cached(input_ids, attention_mask)[0]

    def forward_cached(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: PrefixCache | None = None,
                       build_upto: int = 0) -> tuple[Tensor, PrefixCache | None]:
        """Logits for ``input_ids`` (the positions after ``cache.length`` when a cache is given).

        attention_mask covers the whole sequence [B, cache.length + T]. ``build_upto = s > 0``
        also returns a cache of positions [0, s) for later calls (semi-AR blocks: the prompt and
        finished blocks are then not recomputed).
        """
        out_dev = input_ids.device  # samplers build CPU tensors; the weights may live on a GPU (model.device)
        dev = self.lm_head.weight.device
        input_ids = input_ids.to(dev)
        attention_mask = attention_mask.to(dev) if attention_mask is not None else None
        b, t = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + t > self.config.max_len:
            raise ValueError(f"sequence length {start + t} exceeds max_len={self.config.max_len}")
        # positions are right-aligned: the last position of the sequence is always max_len - 1, so the
        # completion (a fixed completion_len at the end) sits at the same positions whatever the
        # prompt's length, and a left-padded row gets exactly the positions it would get alone (the pad
        # width its batch's longest prompt sets does not move it; measured on the code task, where one
        # 28-character prompt made a whole RL batch decode empty).
        total = attention_mask.shape[1] if attention_mask is not None else start + t
        pos = torch.arange(start, start + t, device=input_ids.device) + (self.config.max_len - total)   # [T]
        h = self.tok_emb(input_ids) + self.pos_emb(pos)[None]
        bias = self._bias(attention_mask, b, h.dtype)
        kvs = []
        for i, blk in enumerate(self.blocks):
            h, kv = blk(h, bias, cache.kv[i] if cache is not None else None)
            kvs.append(kv)
        new_cache = None
        if build_upto > 0:
            new_cache = PrefixCache(build_upto, [(k[:, :, :build_upto], v[:, :, :build_upto]) for k, v in kvs])
        return self.lm_head(self.ln_f(h)).to(out_dev), new_cache              # [B, T, V] on the inputs' device

    def save_pretrained(self, directory: str | Path) -> None:
        save_module(self, self.config.to_dict(), directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "TinyDenoiser":
        return load_module(directory, "miles-tiny", lambda cfg: cls(TinyConfig(**cfg)))
