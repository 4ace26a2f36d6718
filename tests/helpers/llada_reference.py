"""LLaDA's published ``generate`` (and SDAR's block decoder) written out as a reference, and the
log-prob gap between what Miles' sampler records and what the learner scores.

The engine tests check Miles' sampler token for token against ``reference_generate``, and
benchmarks/rollout.py and benchmarks/gpu_check.py time it against the same reference. It is an
independent reimplementation kept for those comparisons, not product code, so it lives with the
tests; the benchmarks import it from here.
"""

from __future__ import annotations

import torch

from miles_core.algo.rows import score_rows
from miles_core.config import SamplerConfig
from miles_core.samplers.sampler import sample


@torch.no_grad()
def reference_generate(model, prompt: torch.Tensor, mask_id: int, forbidden: list[int], gen_length: int,
                       block_length: int, steps: int, max_steps: int | None = None,
                       grid: int = 0) -> tuple[torch.Tensor, int]:
    """LLaDA's ``generate`` at temperature 0 with low-confidence remasking (ML-GSAI/LLaDA generate.py):
    every step a full forward and the whole sequence's logits; ``get_num_transfer_tokens`` per block.
    ``grid`` > 0: SDAR's decoder instead (JetAstra/SDAR @ c2041a8 ``block_diffusion_generate``,
    generate.py and evaluation/opencompass/opencompass/models/huggingface_bd3.py): blocks at absolute
    multiples of the model's attention block ``grid``, starting with the prompt's last, partial one,
    each given ``steps // (gen_length // grid)`` steps; step i commits
    ``get_num_transfer_tokens(grid, steps)[i]`` of its masks, the partial block's too, and the block
    ends when none is left (here the last block ends at the sequence end instead of running past
    it, and a count above the masks left commits just those). Changes: ids Miles never samples ([MASK], pad) are
    suppressed, as Miles' SUBS rule does, the confidence is float32 exp(log-softmax), and equal
    confidences go to the lower position. Stops after ``max_steps`` steps (timing).
    -> (x [B, P + L], steps run)."""
    b, p = prompt.shape
    t = p + gen_length
    x = torch.full((b, t), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    attn = torch.ones_like(x, dtype=torch.bool)
    width = grid or block_length                                        # a whole block, partial or not
    per_block = steps // (gen_length // width)
    if grid:
        edges = [max(p, k * grid) for k in range(p // grid, -(-t // grid))] + [t]
    else:
        edges = list(range(p, t + 1, block_length))
    done = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        left = hi - lo                                                  # the block's masks
        # get_num_transfer_tokens(block_length, steps): the whole block's counts, even when the
        # prompt fills part of it; SDAR's top-k past the masks left changes nothing
        schedule = [width // per_block + (i < width % per_block) for i in range(per_block)]
        for i in range(per_block):
            if max_steps is not None and done >= max_steps:
                return x, done
            n = min(schedule[i], left)
            if n == 0:                                                  # SDAR: no mask left, next block
                break
            left -= n
            mask_index = x == mask_id
            logits = model(x, attn)                                     # [B, T, V]: every position, every step
            logits[..., forbidden] = float("-inf")
            x0 = logits.argmax(-1)
            # LLaDA: F.softmax(logits); exp(log_softmax) is the same p rounded as Miles rounds it, so a
            # near-tie between two positions' confidences cannot decide the comparison
            x0_p = torch.log_softmax(logits.float(), dim=-1).gather(-1, x0[..., None]).squeeze(-1).exp()
            x0_p[:, hi:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf")))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(b):
                # LLaDA: torch.topk, whose order among equal values is unspecified; ties go to the lower
                # position here, as in Miles (Dream's shift makes neighbouring masks tie exactly)
                sel = confidence[j].sort(descending=True, stable=True).indices[:n]
                transfer[j, sel] = True
            x[transfer] = x0[transfer]
            done += 1
    return x, done


def logp_gap(model, tok, prompts: list[list[int]], cfg: SamplerConfig, length: int) -> tuple[float, float]:
    """|log mu - log pi| over committed tokens: recorded by the (cached) sampler vs the learner's
    uncached score of the same (trajectory, step)."""
    batch = sample(model, tok, prompts, cfg, length, torch.Generator().manual_seed(0))
    gaps = []
    with torch.no_grad():
        for b in range(len(batch)):
            k = int(batch.num_steps[b])
            traj, step = torch.full((k,), b), torch.arange(k)
            lp, _, commit = score_rows(model, batch, traj, step, tok, cfg.temperature)
            gaps.append((lp - batch.logp[traj].to(lp.device)).abs()[commit].cpu())
    g = torch.cat(gaps)
    return float(g.mean()), float(g.quantile(0.99))
