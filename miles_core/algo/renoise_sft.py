"""Uniform-noise SFT with self-conditioning for a renoising family (DiffusionGemma).

DiffusionGemma's own training recipe is not public; this is the standard objective of the model
class it belongs to. A clean canvas x_0 (target tokens, EOS-filled to the canvas) is corrupted
position by position with probability t ~ U(0, 1) by uniform random tokens (uniform-state
discrete diffusion: Austin et al., D3PM, arXiv:2107.03006; Schiff et al., UDLM, arXiv:2412.10193),
and the decoder predicts x_0 at every canvas position with cross-entropy. Self-conditioning
follows Chen et al. (Analog Bits, arXiv:2208.04202): half the rows first run the decoder with no
signal, and that estimate, tempered by T ~ U(t_min, t_max) as the sampler tempers it
(samplers/renoise.py), enters the graph-carrying pass as the signal, detached.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from miles_core.models import canvas
from miles_core.config import RenoiseConfig
from miles_core.samplers.step import left_pad


def canvases(tok, prompts: Sequence[str], targets: Sequence[str], length: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> prompt ids [B, P] (left-padded), real [B, P] bool, clean canvases [B, L] (EOS-filled)."""
    prompt, real = left_pad([tok.encode_prompt(p) for p in prompts], tok.pad_id)
    clean = torch.tensor([tok.encode_completion(t, length) for t in targets], dtype=torch.long)
    return prompt, real, clean


def sft_loss(model, prompt: Tensor, real: Tensor, clean: Tensor, cfg: RenoiseConfig,
             generator: torch.Generator, self_cond_prob: float = 0.5) -> Tensor:
    """Mean cross-entropy over canvas positions of x_0 given its corruption x_t (see module doc)."""
    dev = clean.device
    b, length = clean.shape
    vocab = int(canvas.core(model).config.text_config.vocab_size)
    t = torch.rand(b, 1, generator=generator).to(dev)
    noise = torch.randint(0, vocab, (b, length), generator=generator).to(dev)
    x_t = torch.where(torch.rand(b, length, generator=generator).to(dev) < t, noise, clean)
    enc = canvas.encode(model, prompt, real, length, grad=True)
    use = (torch.rand(b, generator=generator) < self_cond_prob).to(dev)
    temp = (cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(b, 1, 1, generator=generator)).to(dev)
    soft = None
    if bool(use.any()):
        with torch.no_grad():
            first = canvas.decode(model, enc, x_t, None) / temp
            soft = canvas.soft_embedding(model, first) * use[:, None, None]
    logits = canvas.decode(model, enc, x_t, soft)                                       # [B, L, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.reshape(-1))
