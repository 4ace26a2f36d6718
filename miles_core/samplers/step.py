"""The one step function: it samples a denoising step, or scores a recorded one.

Sampling and scoring share ``step_from_logits`` so a recorded behaviour log-prob and the
learner's log-prob of the same step are computed by the same arithmetic (a test checks that
scoring a recorded step reproduces its stored value exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepOut:
    tokens: Tensor              # [B, L] sampled (or given) token per completion position
    logp: Tensor                # [B, L] log pi_T(token | state) per completion position
    confidence: Tensor          # [B, L] probability of that token (what low_confidence / NSD rank by)
    entropy: Tensor | None      # [B, L] entropy of pi_T at each position (None when not asked for)


def tempered_logits(logits: Tensor, temperature: float, forbidden: list[int]) -> Tensor:
    """logits/T in float32 with forbidden ids (mask, pad) at -inf (SUBS); T = 0 (greedy) reads T = 1.
    One pass over the vocabulary, into a new tensor: the caller's logits are never written."""
    t = temperature if temperature > 0 else 1.0
    z = logits.float()
    z = z / t if t != 1.0 else z
    if forbidden:
        idx = torch.tensor(forbidden, device=z.device)
        return z.index_fill(-1, idx, float("-inf"))
    return z.clone() if z is logits else z


def denoise_step(model, x: Tensor, attn: Tensor, prompt_width: int, *, temperature: float,
                 forbidden: list[int], generator: torch.Generator | None = None,
                 tokens: Tensor | None = None) -> StepOut:
    """Run the denoiser once on state x [B, T] and sample (tokens=None) or score tokens [B, L].

    The completion occupies x[:, prompt_width:]; only its logits are computed (miles_core/models/window.py).
    Sampling is Gumbel-max on pi_T with the given seeded generator, so it is an exact draw and
    reproducible; temperature 0 is argmax.
    """
    from miles_core.models.window import window_logits

    t = x.shape[1]
    logits, _ = window_logits(model, x, attn, (0, t), (prompt_width, t))   # [B, L, V]
    return step_from_logits(logits, temperature=temperature, forbidden=forbidden, generator=generator, tokens=tokens)


def step_from_logits(logits: Tensor, *, temperature: float, forbidden: list[int],
                     generator: torch.Generator | None = None, tokens: Tensor | None = None,
                     entropy: bool = True) -> StepOut:
    """The sampling/scoring half of ``denoise_step`` for logits computed elsewhere (the sampler's
    block window). log pi_T(token) = z[token] - logsumexp(z) in sampling and scoring alike, so a
    recorded log-prob and the learner's score of it are the same arithmetic; the full log-softmax
    is never materialised (at a 126k vocabulary each pass over [B, L, V] counts). The entropy,
    which only the learner reads, costs two more passes and is skipped with ``entropy=False``."""
    z = tempered_logits(logits, temperature, forbidden)                       # [B, L, V] float32
    lse = torch.logsumexp(z, dim=-1)                                          # [B, L]
    if tokens is None:  # argmax of z: a normaliser's rounding could merge near-ties
        if temperature > 0:
            u = torch.rand(z.shape, generator=generator, device=z.device)
            gumbel = -torch.log((-torch.log(u.clamp(1e-20, 1.0 - 1e-7))).clamp_min(1e-20))
            tokens = (z + gumbel).argmax(-1)
        else:
            tokens = z.argmax(-1)
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse               # [B, L]
    ent = None
    if entropy:  # forbidden ids: p = 0 and log p = -inf, clamped so that 0 * log p = 0
        logp_all = z - lse[..., None]
        ent = -(logp_all.exp() * logp_all.clamp_min(-1e30)).sum(-1)
    return StepOut(tokens=tokens, logp=logp, confidence=logp.exp(), entropy=ent)


def rebuild_state(completion: Tensor, step_map: Tensor, step: Tensor, mask_id: int) -> Tensor:
    """State before step k: positions committed at steps < k are revealed, the rest masked
    (``step_map = -1``, filled without a denoiser call by ``sampler.eos_stop``, is never revealed).

    completion [R, L], step_map [R, L], step [R] -> [R, L]. This is why a trajectory is O(L).
    """
    seen = (step_map >= 0) & (step_map < step[:, None])
    return torch.where(seen, completion, torch.full_like(completion, mask_id))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Ragged prompts -> ([B, P] ids left-padded, [B, P] bool real-token mask).

    Padded as Python lists, then one tensor for the whole batch, not one per row: the learner pads
    every scoring chunk's prompts, and a per-row loop was 4% of the asynchronous learner's time
    (py-spy). Nothing is read back from a tensor (tests/test_engine.py counts reads)."""
    rows = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompts]
    lens = [len(r) for r in rows]
    width = max(lens, default=0)
    ids = torch.tensor([[pad_id] * (width - n) + r for n, r in zip(lens, rows)], dtype=torch.long).reshape(len(rows), width)
    real = torch.arange(width) >= (width - torch.tensor(lens, dtype=torch.long))[:, None]  # [B, P]
    return ids, real
