"""Miles' character denoiser as transformers remote code: the file a ``miles-tiny`` folder carries.

Every tiny checkpoint and export holds a copy of this file and names it in ``config.json``'s
``auto_map``, so the folder opens where Miles is not installed, as LLaDA's and Dream's published
folders do::

    model = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # tokenizer.json
    logits = model(**tok(["1+2"], return_tensors="pt")).logits   # [B, T, V]

It imports torch and transformers only. :class:`Block` is the one implementation of the layer:
``miles_core/models/tiny.py`` builds its denoiser from it and adds what sampling needs (windows and
a key/value cache); :class:`MilesTinyModel` is the whole-sequence pass, parameter names equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


class Block(nn.Module):
    """Pre-norm attention + GELU MLP, no causal mask; linear layers named as a Llama's, so peft LoRA
    targets them the same way."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

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


def right_aligned_positions(start: int, stop: int, total: int, max_len: int, device: torch.device) -> Tensor:
    """Positions of ``[start, stop)`` in a sequence of ``total`` ids, right-aligned so the last one is
    ``max_len - 1``: a fixed-length completion at the end sits at the same positions whatever the
    prompt's length, and a left-padded row is scored as it would be alone. -> [stop - start]"""
    if total > max_len:
        raise ValueError(f"sequence length {total} exceeds max_len={max_len}")
    return torch.arange(start, stop, device=device) + (max_len - total)


def init_weights(module: nn.Module) -> None:
    """The denoiser's initialisation: N(0, 0.02) weights, zero biases (``module.apply(init_weights)``)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def padding_bias(key_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """key_mask [B, Tk] bool (True = a real token) -> an additive attention bias [B, 1, 1, Tk]:
    0 for real keys, -inf for padding."""
    bias = torch.zeros(key_mask.shape[0], 1, 1, key_mask.shape[1], dtype=dtype, device=key_mask.device)
    return bias.masked_fill(~key_mask[:, None, None, :], float("-inf"))


class MilesTinyConfig(PretrainedConfig):
    model_type = "miles-tiny"

    def __init__(self, vocab_size: int = 100, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 d_ff: int = 512, max_len: int = 96, **kwargs) -> None:
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.n_heads, self.d_ff, self.max_len = n_heads, d_ff, max_len
        super().__init__(**kwargs)


class MilesTinyModel(PreTrainedModel):
    """input_ids [B, T] (+ attention_mask [B, T], 1 = real token) -> MaskedLMOutput(logits [B, T, V]):
    the denoiser's logits at every position, masked ones included (the mask token is ``[MASK]``)."""

    config_class = MilesTinyConfig
    base_model_prefix = "miles_tiny"

    def __init__(self, config: MilesTinyConfig) -> None:
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads, config.d_ff) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> MaskedLMOutput:
        b, t = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = right_aligned_positions(0, t, t, self.config.max_len, input_ids.device)    # [T]
        h = self.tok_emb(input_ids) + self.pos_emb(pos)[None]                             # [B, T, D]
        bias = padding_bias(mask, h.dtype)                                                # [B, 1, 1, T]
        for blk in self.blocks:
            h, _ = blk(h, bias)
        return MaskedLMOutput(logits=self.lm_head(self.ln_f(h)))                          # [B, T, V]
