"""A small bidirectional transformer denoiser for absorbing-state ([MASK]) diffusion.

No causal mask: every position sees every other (prompt and completion), as in LLaDA/MDLM.
Linear layers are named q_proj/k_proj/v_proj/o_proj/fc1/fc2 so peft LoRA targets them the same
way it targets a Llama backbone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


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

    def forward(self, h: Tensor, attn_bias: Tensor | None) -> Tensor:
        b, t, d = h.shape
        x = self.ln1(h)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (p(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


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

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b, t = input_ids.shape
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.config.max_len}")
        pos = torch.arange(t, device=input_ids.device)
        h = self.tok_emb(input_ids) + self.pos_emb(pos)[None]
        bias = None
        if attention_mask is not None:
            # [B, 1, 1, T]: padded keys get -inf, every query still sees all real tokens
            bias = torch.zeros(b, 1, 1, t, dtype=h.dtype, device=h.device)
            bias = bias.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
        for blk in self.blocks:
            h = blk(h, bias)
        return self.lm_head(self.ln_f(h))

    def flops_per_token(self, seq_len: int) -> int:
        """Analytic forward FLOPs per token (2 per multiply-add): linears + attention scores."""
        c = self.config
        per_layer = 2 * (4 * c.d_model * c.d_model + 2 * c.d_model * c.d_ff) + 2 * 2 * seq_len * c.d_model
        return c.n_layers * per_layer + 2 * c.d_model * c.vocab_size

    def save_pretrained(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(d / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "TinyDenoiser":
        d = Path(directory)
        for name in ("config.json", "model.safetensors"):
            if not (d / name).exists():
                raise FileNotFoundError(f"checkpoint {d} is missing {name}")
        cfg = json.loads((d / "config.json").read_text())
        if cfg.get("model_type") != "miles-tiny":
            raise ValueError(f"{d}/config.json: model_type {cfg.get('model_type')!r} is not 'miles-tiny'")
        model = cls(TinyConfig(**cfg))
        model.load_state_dict(load_file(str(d / "model.safetensors")))
        return model
