"""Masked-diffusion samplers that record trajectories.

One loop serves every schedule: a step runs ``denoise_step`` on the rows that still have masked
positions in their current block, and a commit rule picks which positions to reveal:
  * static: a fixed number per step (LLaDA ``get_num_transfer_tokens``), ranked by confidence
    (``low_confidence``) or at random (``random``);
  * nsd: every position whose confidence passes a threshold, at least ``min_per_step`` and at
    most ``max_per_step`` (Native Speculative Denoising).
Rows that finish stop costing denoiser calls, so NFE is counted per sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_core.config import SamplerConfig
from miles_core.samplers.step import left_pad, step_from_logits
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


def block_ranges(length: int, block_size: int) -> list[tuple[int, int]]:
    b = length if block_size <= 0 else block_size
    if length % b != 0:
        raise ValueError(f"block_size={block_size} must divide completion_len={length}")
    return [(s, s + b) for s in range(0, length, b)]


def static_counts(block_len: int, steps_per_block: int) -> list[int]:
    """Tokens to commit at each step of a block: as even as possible, remainder first (LLaDA)."""
    if steps_per_block < 1 or steps_per_block > block_len:
        raise ValueError(f"steps per block must be in [1, {block_len}], got {steps_per_block}")
    base, rem = divmod(block_len, steps_per_block)
    return [base + 1] * rem + [base] * (steps_per_block - rem)


def topk_commit(score: Tensor, eligible: Tensor, n: Tensor) -> Tensor:
    """Commit the n[b] highest-scoring eligible positions of each row. [B, L], [B, L], [B] -> [B, L]."""
    s = score.masked_fill(~eligible, float("-inf"))
    order = s.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(s.shape[1], device=s.device).expand_as(order))
    return (ranks < n[:, None]) & eligible


def nsd_commit(conf: Tensor, eligible: Tensor, threshold: float, lo: int, hi: int) -> Tensor:
    """Confident positions (conf >= threshold), clamped to [lo, hi] per row (highest first).

    threshold >= 1 means "never confident enough": exactly ``lo`` per step, so NSD then equals
    the static low-confidence schedule with ``lo`` tokens per step (a test checks it bit for bit).
    """
    if threshold >= 1.0:
        n_conf = torch.zeros(conf.shape[0], dtype=torch.long, device=conf.device)
    else:
        n_conf = ((conf >= threshold) & eligible).sum(1)
    n = n_conf.clamp(min=lo, max=hi).minimum(eligible.sum(1))
    return topk_commit(conf, eligible, n)


@torch.no_grad()
def sample(model, tok: CharTokenizer, prompt_ids: list[list[int]], cfg: SamplerConfig, completion_len: int,
           generator: torch.Generator, group_id: Tensor | None = None, policy_version: int = 0,
           threshold: float | None = None) -> TrajectoryBatch:
    """Sample completions for ``prompt_ids`` and record each trajectory (step_map, logp, NFE)."""
    b, length = len(prompt_ids), completion_len
    prompt, real = left_pad(prompt_ids, tok.pad_id)
    width = prompt.shape[1]
    x = torch.cat([prompt, torch.full((b, length), tok.mask_id, dtype=torch.long)], dim=1)  # [B, T]
    attn = torch.cat([real, torch.ones(b, length, dtype=torch.bool)], dim=1)
    step_map = torch.full((b, length), -1, dtype=torch.long)
    logp = torch.zeros(b, length)
    nfe = torch.zeros(b, dtype=torch.long)
    blocks = block_ranges(length, cfg.block_size)
    if cfg.kind == "static" and cfg.steps % len(blocks) != 0:
        raise ValueError(f"sampler.steps={cfg.steps} must be a multiple of the number of blocks ({len(blocks)})")
    thr = cfg.threshold if threshold is None else threshold
    use_cache = cfg.block_cache and hasattr(model, "forward_cached")
    cache = None
    for lo, hi in blocks:
        in_block = torch.zeros(length, dtype=torch.bool)
        in_block[lo:hi] = True
        counts = static_counts(hi - lo, cfg.steps // len(blocks)) if cfg.kind == "static" else []
        j = 0
        while True:
            masked = x[:, width:] == tok.mask_id                       # [B, L]
            eligible_all = masked & in_block[None]
            active = eligible_all.any(1).nonzero().squeeze(1)          # rows with work in this block
            if active.numel() == 0:
                break
            if not use_cache:
                logits = model(x[active], attn[active])[:, width:]                      # [A, L, V]
            elif j == 0:  # block start: one full pass, which also caches prompt + finished blocks
                assert active.numel() == b, "every row has work at the start of a block"
                full, cache = model.forward_cached(x, attn, build_upto=width + lo)
                logits = full[:, width:]
            else:  # only the current block and what follows are recomputed
                part, _ = model.forward_cached(x[active, width + lo:], attn[active], cache.select(active))
                logits = torch.cat([part.new_zeros(active.numel(), lo, part.shape[-1]), part], dim=1)
            out = step_from_logits(logits, temperature=cfg.temperature, forbidden=tok.forbidden_ids,
                                   generator=generator)
            eligible = eligible_all[active]
            if cfg.kind == "static":
                n = torch.full((active.numel(),), counts[j], dtype=torch.long)
                score = out.confidence if cfg.remasking == "low_confidence" else torch.rand(
                    out.confidence.shape, generator=generator)
                commit = topk_commit(score, eligible, n)
            else:
                commit = nsd_commit(out.confidence, eligible, thr, cfg.min_per_step, cfg.max_per_step)
            comp = x[active, width:]
            x[active, width:] = torch.where(commit, out.tokens, comp)
            step_map[active] = torch.where(commit, nfe[active, None], step_map[active])
            logp[active] = torch.where(commit, out.logp, logp[active])
            nfe[active] += 1
            j += 1
    completion = x[:, width:].clone()
    gid = group_id if group_id is not None else torch.arange(b)
    return TrajectoryBatch(
        prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion, step_map=step_map, logp=logp,
        nfe=nfe, group_id=gid.long(), policy_version=torch.full((b,), policy_version, dtype=torch.long),
        prompts=[tok.decode(p) for p in prompt_ids], completions=[tok.decode(c.tolist()) for c in completion],
        meta=[{} for _ in range(b)], sampler_hash=cfg.hash(completion_len),
    )

