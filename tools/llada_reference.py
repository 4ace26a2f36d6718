"""LLaDA's published ``generate`` (and SDAR's block decoder) written out as a reference, and the
log-prob gap between what Miles' sampler records and what the learner scores.

The engine tests check Miles' sampler decision by decision against the reference rule
(``replay_decisions``; token for token where no near-tie can decide, tests/test_sdar_schedule.py), and
benchmarks/speed/rollout.py and benchmarks/speed/gpu_check.py time it against the same reference. It is an
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


@torch.no_grad()
def replay_decisions(model, prompt: list[int], completion: torch.Tensor, step_map: torch.Tensor, mask_id: int,
                     forbidden: list[int], block_length: int, grid: int = 0, tol: float = 1e-5) -> dict[str, int]:
    """Check one row of a greedy rollout decision by decision against the reference rule, replayed on
    the rollout's own trajectory (teacher forcing): before each step, the state is the prompt plus
    the tokens committed at earlier steps; the reference's full forward must pick the same token at
    each committed position and the same positions (the highest log-confidences among the current
    block's masks), unless that decision was a near-tie: a top-1/top-2 logit gap, or a gap between the
    last chosen and the first unchosen log-confidence, below ``tol``. Why not compare two decodings
    token for token: on random weights some decisions are ties to 1e-6, which summation order (threads,
    load) flips, and one flip changes everything after it. -> counts: decisions, near_ties, mismatches
    (decisions that differ with a clear margin: a real difference of rule)."""
    p, length = len(prompt), completion.shape[0]
    t = p + length
    out = {"decisions": 0, "near_ties": 0, "mismatches": 0}
    for s in step_map.unique().tolist():
        x = torch.full((1, t), mask_id, dtype=torch.long)
        x[0, :p] = torch.tensor(prompt)
        before = step_map < s
        x[0, p:][before] = completion[before]
        now = (step_map == s).nonzero().squeeze(-1)                     # positions committed at step s
        c = int(now.max())
        hi = (min(t, ((p + c) // grid + 1) * grid) if grid else min(t, p + (c // block_length + 1) * block_length))
        logits = model(x, torch.ones_like(x, dtype=torch.bool))[0].float()   # [T, V]
        logits[..., forbidden] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        top2 = logits.topk(2, dim=-1)
        masked = (x[0] == mask_id).nonzero().squeeze(-1)
        masked = masked[masked < hi]                                     # the current block's masks
        conf = logp[masked].max(-1).values                               # log-confidence of each mask
        order = conf.sort(descending=True, stable=True)
        n = len(now)
        chosen = set((masked[order.indices[:n]] - p).tolist())
        boundary = float(order.values[n - 1] - order.values[n]) if n < len(masked) else float("inf")
        out["decisions"] += 1
        if boundary < tol:
            out["near_ties"] += 1
        elif chosen != set(now.tolist()):
            out["mismatches"] += 1
        for pos in now.tolist():
            out["decisions"] += 1
            gap = float(top2.values[p + pos, 0] - top2.values[p + pos, 1])
            if gap < tol:
                out["near_ties"] += 1
            elif int(top2.indices[p + pos, 0]) != int(completion[pos]):
                out["mismatches"] += 1
    return out


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
