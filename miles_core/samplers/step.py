"""The one step function: it samples a denoising step, or scores a recorded one.

Sampling and scoring share ``token_logprobs`` so a recorded behaviour log-prob and the
learner's log-prob of the same step are computed by the same arithmetic (a test checks that
scoring a recorded step reproduces its stored value exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepOut:
    tokens: Tensor      # [B, L] sampled (or given) token per completion position
    logp: Tensor        # [B, L] log pi_T(token | state) per completion position
    confidence: Tensor  # [B, L] probability of that token (what low_confidence / NSD rank by)
    entropy: Tensor     # [B, L] entropy of pi_T at each completion position


def tempered_log_softmax(logits: Tensor, temperature: float, forbidden: list[int]) -> Tensor:
    """log pi_T over the vocabulary: logits/T with forbidden ids (mask, pad) at -inf (SUBS).

    ``temperature == 0`` means greedy decoding; its log-probs are reported at T = 1.
    """
    t = temperature if temperature > 0 else 1.0
    z = logits.float() / t
    if forbidden:
        z = z.clone()
        z[..., forbidden] = float("-inf")
    return torch.log_softmax(z, dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float, forbidden: list[int]) -> Tensor:
    """[..., V] logits, [...] tokens -> [...] log pi_T(tokens)."""
    logp_all = tempered_log_softmax(logits, temperature, forbidden)
    return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def denoise_step(model, x: Tensor, attn: Tensor, prompt_width: int, *, temperature: float,
                 forbidden: list[int], generator: torch.Generator | None = None,
                 tokens: Tensor | None = None) -> StepOut:
    """Run the denoiser once on state x [B, T] and sample (tokens=None) or score tokens [B, L].

    The completion occupies x[:, prompt_width:]. Sampling is Gumbel-max on pi_T with the given
    seeded generator, so it is an exact draw and reproducible; temperature 0 is argmax.
    """
    logits = model(x, attn)[:, prompt_width:]                  # [B, L, V]
    return step_from_logits(logits, temperature=temperature, forbidden=forbidden, generator=generator, tokens=tokens)


def step_from_logits(logits: Tensor, *, temperature: float, forbidden: list[int],
                     generator: torch.Generator | None = None, tokens: Tensor | None = None) -> StepOut:
    """The sampling/scoring half of ``denoise_step`` for logits computed elsewhere (block cache)."""
    logp_all = tempered_log_softmax(logits, temperature, forbidden)
    if tokens is None:
        if temperature > 0:
            u = torch.rand(logp_all.shape, generator=generator, device=logp_all.device)
            gumbel = -torch.log((-torch.log(u.clamp(1e-20, 1.0 - 1e-7))).clamp_min(1e-20))
            tokens = (logp_all + gumbel).argmax(-1)
        else:
            tokens = logp_all.argmax(-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, L]
    probs = logp_all.exp()
    entropy = -(probs * logp_all.clamp_min(-1e30)).sum(-1)
    return StepOut(tokens=tokens, logp=logp, confidence=logp.exp(), entropy=entropy)


def rebuild_state(completion: Tensor, step_map: Tensor, step: Tensor, mask_id: int) -> Tensor:
    """State before step k: positions committed at steps < k are revealed, the rest masked
    (``step_map = -1``, filled without a denoiser call by ``sampler.eos_stop``, is never revealed).

    completion [R, L], step_map [R, L], step [R] -> [R, L]. This is why a trajectory is O(L).
    """
    seen = (step_map >= 0) & (step_map < step[:, None])
    return torch.where(seen, completion, torch.full_like(completion, mask_id))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Ragged prompts -> ([B, P] ids left-padded, [B, P] bool real-token mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            real[i, width - len(p):] = True
    return ids, real
