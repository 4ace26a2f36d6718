"""Masked-diffusion samplers that record trajectories, on the model's device.

One loop serves every schedule: a step runs the denoiser on the rows that still have masked
positions in their current block, and a commit rule picks which positions to reveal:
  * static: a fixed number per step (LLaDA ``get_num_transfer_tokens``), ranked by confidence
    (``low_confidence``) or at random (``random``); a block the prompt or the sequence end cuts
    short (SDAR's grid) keeps the full block's schedule until its masks run out (``transfer_counts``);
  * nsd: every position whose confidence passes a threshold, at least ``min_per_step`` and at
    most ``max_per_step`` (Native Speculative Denoising).

Everything lives on the model's device: state, seeded noise, commit rules. Logits are computed
for the current block only (miles_core/models/window.py) and never leave the device; what comes back to the
host is the final tokens, ``step_map``, log-probs and NFE. The host reads the device once per
block (which rows have work) and, under NSD, the rows' mask counts [A] only at steps after which
a row can have finished (``next_finish``: the fewest masks left over ``max_per_step``); a static
block has a known number of steps and no read at all. So a GPU queue is drained only where a read
can save a forward, and a row that finishes costs no further denoiser call: every forward a row
takes is one of its NFE (a test counts them). NFE is counted per sequence (steps in which it had a
position to decide).

``sampler.cache`` (prefix / dual, Fast-dLLM) reuses keys/values inside a block; the recorded
log-probs are those of the distribution actually sampled from. ``sampler.eos_stop``: a row whose
finished blocks contain EOS skips its later blocks, filled with EOS and marked ``step_map = -1``
(never revealed in a recorded state, never scored: no denoiser saw them).

``refresh`` (in-flight policy refresh, PipelineRL's in-flight weight updates at a denoising step's
grain): between two forwards the sampler asks it whether a newer adapter is in memory; it swaps
the LoRA tensors in place and the next step samples with them. Each step's log-probs are those of
the adapter that took it, and ``step_version`` records which, so nothing is recomputed: the learner
weighs each recorded step by its own behaviour log-prob as it always does. A KV cache holds keys
and values of the older weights, so a swap drops it (the next forward is a block's first pass).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from miles_core.config import ConfigError, SamplerConfig
from miles_core.models.window import KVCache, attention_grid, logit_shift, model_device, supports_cache, window_logits
from miles_core.samplers.step import left_pad, step_from_logits
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


class Refresh(Protocol):
    """In-flight refresh (module docstring): called between two denoiser forwards of a rollout,
    ``forwards`` of them done so far; swaps a newer adapter into the model in place and returns
    its version, or returns None to keep sampling with the loaded one."""

    def __call__(self, forwards: int) -> int | None:
        ...


def block_ranges(length: int, block_size: int) -> list[tuple[int, int]]:
    b = length if block_size <= 0 else block_size
    if length % b != 0:
        raise ValueError(f"block_size={block_size} must divide completion_len={length}")
    return [(s, s + b) for s in range(0, length, b)]


def grid_blocks(length: int, grid: int, offsets: list[int]) -> list[tuple[int, int, list[int], list[int]]]:
    """Decoding blocks of ``grid`` positions, per row. On a block-causal model they are its own
    attention blocks (SDAR: absolute multiples of its ``block_size``; JetAstra/SDAR ``generate.py``
    decodes block by block from the prompt's last, partial block): row b's completion starts
    ``offsets[b]`` positions into an attention block (its real prompt length mod ``grid``), so its
    k-th decoding block is completion positions [k*grid - o_b, (k+1)*grid - o_b) within
    [0, length), the first partial when the prompt ends mid-block, and so is the last. Offsets 0:
    the same blocks for every row. Returns per block (lo, hi, start [B], end [B]), plain ints (the
    host knows the prompt lengths; nothing is read from a device): the columns every row's part
    lies in, and each row's own part."""
    clip = lambda v: min(max(v, 0), length)  # noqa: E731
    out = []
    for k in range(-(-(length + max(offsets, default=0)) // grid)):
        start = [clip(k * grid - o) for o in offsets]
        end = [clip((k + 1) * grid - o) for o in offsets]
        out.append((min(start), max(end), start, end))
    return out


def static_counts(block_len: int, steps_per_block: int) -> list[int]:
    """Tokens to commit at each step of a block: as even as possible, remainder first (LLaDA)."""
    if steps_per_block < 1 or steps_per_block > block_len:
        raise ValueError(f"steps per block must be in [1, {block_len}], got {steps_per_block}")
    base, rem = divmod(block_len, steps_per_block)
    return [base + 1] * rem + [base] * (steps_per_block - rem)


def transfer_counts(masked: int, block_len: int, steps: int) -> list[int]:
    """Tokens to commit at each of a block's ``steps`` when only ``masked`` of its ``block_len``
    positions are masks: the full block's ``static_counts`` step by step until the masks run out,
    then nothing (the block needs fewer steps; the sampler stops there).

    Why: it is SDAR's official rule for the partial first block (the prompt ends inside it).
    ``block_diffusion_generate`` commits ``get_num_transfer_tokens(block_length, steps)[step]``
    top-confidence positions per step in every block, that one included, and stops once no mask
    is left (JetAstra/SDAR @ c2041a8, evaluation/opencompass/opencompass/models/huggingface_bd3.py,
    whose top-k past the masks rewrites tokens with themselves; generate.py's copy writes its
    predictions there instead, which Miles never does). Spreading the steps over the masks (2 masks,
    2 steps: one a step) decodes differently whenever steps < block_len; at steps = block_len both
    commit one a step. The last block, which the official decoder runs past the sequence end and
    Miles ends there, gets the same rule. A full block (every block of a model without an
    attention grid) gets ``static_counts`` itself."""
    out, left = [], masked
    for n in static_counts(block_len, steps):
        out.append(min(n, left))
        left -= out[-1]
    return out


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


def next_finish(fewest_masks: int, max_per_step: int) -> int:
    """Steps until the first row can run out of masks, when the row with the fewest has
    ``fewest_masks`` left and a step commits at most ``max_per_step``: NSD reads its rows' mask
    counts exactly then, so a finished row never costs a forward (it leaves the batch before the
    next one) and a read is never spent where no row can have finished."""
    return max(1, -(-fewest_masks // max_per_step))


def device_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """The caller's seeded CPU generator, or (model on a GPU) a generator there seeded from one draw
    of it, so the noise is drawn where it is used and a run stays reproducible from its seed."""
    if generator.device == device or device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def block_logits(model, x: Tensor, attn: Tensor, lo: int, hi: int, mode: str, cache: KVCache | None
                 ) -> tuple[Tensor, KVCache | None]:
    """Logits [A, hi - lo, V] of block [lo, hi) (absolute positions) of states x [A, T].

    mode ``none``: a full pass each step. ``prefix`` / ``dual`` with ``cache=None`` (a block's first
    step): a full pass that keeps keys/values of [0, s) (dual: and [hi, T)); with a cache: a pass
    over [s, T) (prefix) or [s, hi) (dual) only. s = lo, or lo - 1 for Dream's shifted logits."""
    t = x.shape[1]
    if mode == "none":
        return window_logits(model, x, attn, (0, t), (lo, hi))
    s = max(lo - logit_shift(model), 0)
    if cache is None:
        keep = ((0, s),) if mode == "prefix" else ((0, s), (hi, t))
        keep = tuple((a, b) for a, b in keep if b > a)
        return window_logits(model, x, attn, (0, t), (lo, hi), keep=keep)
    query = (s, t) if mode == "prefix" else (s, hi)
    return window_logits(model, x, attn, query, (lo, hi), cache=cache)[0], cache


@torch.no_grad()
def sample(model, tok: CharTokenizer, prompt_ids: list[list[int]], cfg: SamplerConfig, completion_len: int,
           generator: torch.Generator, group_id: Tensor | None = None, policy_version: int = 0,
           threshold: float | None = None, refresh: Refresh | None = None) -> TrajectoryBatch:
    """Sample completions for ``prompt_ids`` and record each trajectory (step_map, logp, NFE);
    ``policy_version`` is the loaded adapter's, ``refresh`` may swap a newer one in between steps
    (module docstring: then ``step_version`` records each position's)."""
    dev = model_device(model)
    gen = device_generator(generator, dev)
    b, length = len(prompt_ids), completion_len
    prompt, real = left_pad(prompt_ids, tok.pad_id)
    width = prompt.shape[1]
    x = torch.cat([prompt, torch.full((b, length), tok.mask_id, dtype=torch.long)], dim=1).to(dev)   # [B, T]
    attn = torch.cat([real, torch.ones(b, length, dtype=torch.bool)], dim=1).to(dev)                 # [B, T]
    step_map = torch.full((b, length), -1, dtype=torch.long, device=dev)
    logp = torch.zeros(b, length, device=dev)
    nfe = torch.zeros(b, dtype=torch.long, device=dev)
    version, forwards = policy_version, 0
    step_version = torch.full((b, length), policy_version, dtype=torch.long, device=dev)  # [B, L]
    grid = attention_grid(model)  # block-causal: decode on its attention blocks (0 = "the model's")
    if grid and cfg.block_size not in (0, grid):
        raise ConfigError(f"sampler.block_size={cfg.block_size}: this model is block-causal with attention blocks of "
                          f"{grid}; decoding blocks must be its attention blocks (sampler.block_size={grid} or 0)")
    blocks = block_ranges(length, grid or cfg.block_size)
    if cfg.kind == "static" and cfg.steps % len(blocks) != 0:
        raise ValueError(f"sampler.steps={cfg.steps} must be a multiple of the number of blocks ({len(blocks)})")
    per_block = cfg.steps // len(blocks)
    block = blocks[0][1] - blocks[0][0]
    if cfg.kind == "static":
        static_counts(block, per_block)  # validates steps per block against its length
    if cfg.cache != "none" and not supports_cache(model):
        raise ConfigError(f"sampler.cache={cfg.cache!r}: {type(model).__name__} has no KV cache; use sampler.cache=none")
    # columns [lo, hi) of every decoding block and each row's part of it: on a block-causal model's
    # grid, from each row's prompt length; else offset 0, the same blocks for every row
    plan = grid_blocks(length, block, [len(p) % grid if grid else 0 for p in prompt_ids])
    thr = cfg.threshold if threshold is None else threshold
    stopped = torch.zeros(b, dtype=torch.bool, device=dev)
    for lo, hi, start, end in plan:
        a, e = width + lo, width + hi
        col = torch.arange(lo, hi)
        part = ((col >= torch.tensor(start)[:, None]) & (col < torch.tensor(end)[:, None])).to(dev)  # [B, Lb]
        todo = ((x[:, a:e] == tok.mask_id) & part).any(1) & ~stopped
        rows = todo.nonzero().squeeze(1)              # the block's one host read: rows with work in it
        if rows.numel() == 0:
            continue
        part = part[rows]
        counts, last = None, 0
        if cfg.kind == "static":  # a row's part starts all masks: its schedule is known on the host
            table = [transfer_counts(hi_b - lo_b, block, per_block) for lo_b, hi_b in zip(start, end)]
            last = max(sum(n > 0 for n in t) for t in table)      # steps some row has a token to commit in
            counts = torch.tensor(table, dtype=torch.long, device=dev)[rows]       # [A, per_block]
        else:  # NSD: a row's part starts all masks and loses at most max_per_step a step
            read_at = next_finish(min(hi_b - lo_b for hi_b, lo_b in zip(end, start) if hi_b > lo_b), cfg.max_per_step)
        cache: KVCache | None = None
        j = 0
        while True:
            newer = refresh(forwards) if refresh is not None and forwards else None
            if newer is not None:  # the next step samples with the newer adapter: older keys/values go
                version, cache = newer, None
            forwards += 1
            xs = x[rows]                                                             # [A, T]
            logits, cache = block_logits(model, xs, attn[rows], a, e, cfg.cache, cache)   # [A, Lb, V]
            out = step_from_logits(logits, temperature=cfg.temperature, forbidden=tok.forbidden_ids,
                                   generator=gen, entropy=False)
            eligible = (xs[:, a:e] == tok.mask_id) & part                            # [A, Lb]
            if cfg.kind == "static":
                score = out.confidence if cfg.remasking == "low_confidence" else torch.rand(
                    out.confidence.shape, generator=gen, device=dev)
                commit = topk_commit(score, eligible, counts[:, j])
            else:
                commit = nsd_commit(out.confidence, eligible, thr, cfg.min_per_step, cfg.max_per_step)
            x[rows, a:e] = torch.where(commit, out.tokens, xs[:, a:e])
            step_map[rows, lo:hi] = torch.where(commit, nfe[rows, None], step_map[rows, lo:hi])
            logp[rows, lo:hi] = torch.where(commit, out.logp, logp[rows, lo:hi])
            if version != policy_version:
                step_version[rows, lo:hi] = step_version[rows, lo:hi].masked_fill(commit, version)
            nfe[rows] += eligible.any(1).long()
            j += 1
            if cfg.kind == "static":
                if j == last:                        # a static block ends after its steps: no host read
                    break
            elif j == read_at:  # the first step after which some row may have no mask left
                masks = ((x[rows, a:e] == tok.mask_id) & part).sum(1)                # [A] masks left
                left = masks.nonzero().squeeze(1)       # NSD's read: which rows go on (the queue drains here)
                if left.numel() == 0:
                    break
                fewest = int(masks[left].min())         # and the soonest one of them can finish (no second wait)
                if left.numel() < masks.numel():
                    rows, part, cache = rows[left], part[left], cache.select(left) if cache is not None else None
                read_at = j + next_finish(fewest, cfg.max_per_step)
        if cfg.eos_stop:
            stopped |= (x[:, width:e] == tok.eos_id).any(1)
    if cfg.eos_stop:  # skipped blocks: EOS, never revealed in a recorded state (step_map -1)
        x[:, width:] = x[:, width:].masked_fill(x[:, width:] == tok.mask_id, tok.eos_id)
    completion = x[:, width:].cpu()
    gid = group_id if group_id is not None else torch.arange(b)
    return TrajectoryBatch(
        prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion, step_map=step_map.cpu(),
        logp=logp.cpu(), nfe=nfe.cpu(), group_id=gid.long(),
        policy_version=torch.full((b,), policy_version, dtype=torch.long),
        prompts=[tok.decode(p) for p in prompt_ids], completions=[tok.decode(c.tolist()) for c in completion],
        meta=[{} for _ in range(b)], sampler_hash=cfg.hash(completion_len),
        step_version=step_version.cpu() if version != policy_version else None,
    )
