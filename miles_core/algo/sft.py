"""Masked-diffusion SFT: the prompt is never masked, each answer token is masked with
probability t ~ U(0, 1], and the loss is cross-entropy on masked answer positions weighted 1/t
(the MDLM / LLaDA ELBO), averaged over answer positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from miles_core.algo.schedule import Schedule, lr_factor
from miles_core.progress import track
from miles_core.samplers.step import left_pad
from miles_core.tokenizer import CharTokenizer


@dataclass
class SFTBatch:
    x: Tensor        # [B, T] prompt (left-padded) + target completion
    attn: Tensor     # [B, T] real-token mask
    width: int       # prompt width P; the completion is x[:, P:]


def make_batch(tok: CharTokenizer, prompts: Sequence[str], targets: Sequence[str], completion_len: int) -> SFTBatch:
    prompt, real = left_pad([tok.encode_prompt(p) for p in prompts], tok.pad_id)
    comp = torch.tensor([tok.encode_completion(t, completion_len) for t in targets], dtype=torch.long)
    x = torch.cat([prompt, comp], dim=1)
    attn = torch.cat([real, torch.ones_like(comp, dtype=torch.bool)], dim=1)
    return SFTBatch(x, attn, prompt.shape[1])


def sft_loss(model, batch: SFTBatch, mask_id: int, generator: torch.Generator,
             t_min: float = 1e-3) -> tuple[Tensor, dict[str, float]]:
    """Returns (loss, stats). Only completion positions can be masked or contribute."""
    comp = batch.x[:, batch.width:]                                         # [B, L]
    b, length = comp.shape
    t = torch.rand(b, 1, generator=generator) * (1 - t_min) + t_min         # [B, 1]
    masked = torch.rand(b, length, generator=generator) < t                  # [B, L]
    x = batch.x.clone()
    x[:, batch.width:] = comp.masked_fill(masked, mask_id)
    logits = model(x, batch.attn)[:, batch.width:]                          # [B, L, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), comp.reshape(-1), reduction="none").view(b, length)
    loss = (ce * masked / t).sum() / (b * length)
    with torch.no_grad():
        acc = ((logits.argmax(-1) == comp) & masked).sum() / masked.sum().clamp_min(1)
    return loss, {"loss": float(loss.detach()), "masked_acc": float(acc), "masked_frac": float(masked.float().mean())}


def train_sft(model, tok: CharTokenizer, prompts: Sequence[str], targets: Sequence[str], *, completion_len: int,
              steps: int, batch_size: int, lr: float, weight_decay: float = 0.01, warmup: int = 100, seed: int = 0,
              lr_schedule: Schedule = "constant",
              callback: Callable[[int, dict[str, float]], bool | None] | None = None, callback_every: int = 0,
              progress: bool = False, time_budget_s: float | None = None) -> list[dict[str, float]]:
    """Plain SFT loop over a fixed labelled set.

    ``callback(step, stats)`` runs every ``callback_every`` steps and may return True to stop
    early (plateau detection); ``time_budget_s`` stops after that much wall-clock time (used to
    give continued SFT exactly the time an RL run took). ``lr_schedule`` after the warm-up:
    constant, or a linear / cosine decay to 0 at ``steps`` (algo/schedule.py). Each step's stats
    carry the ``lr`` it used.
    """
    import time

    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(warmup, lr_schedule, steps))
    n = len(prompts)
    history = []
    it = track(range(steps), steps, "sft", enabled=progress)
    model.train()
    for step in it:
        idx = torch.randint(0, n, (batch_size,), generator=gen).tolist()
        batch = make_batch(tok, [prompts[i] for i in idx], [targets[i] for i in idx], completion_len)
        loss, stats = sft_loss(model, batch, tok.mask_id, gen)
        stats["lr"] = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(stats)
        if callback is not None and callback_every and (step + 1) % callback_every == 0:
            stop = callback(step + 1, dict(stats))
            model.train()
            if stop:
                break
        if time_budget_s is not None and time.perf_counter() - t_start >= time_budget_s:
            break
    return history
