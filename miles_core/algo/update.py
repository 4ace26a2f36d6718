"""One ADPO policy update over a batch of recorded trajectories.

Every recorded step is an independent row (trajectory b, step k): its state is rebuilt from
``step_map``, scored with the same step function that sampled it, and backpropagated on its own
(chunks of ``row_chunk`` rows). Nothing is ever backpropagated through the denoising chain, so
peak memory depends on the chunk size, not on the number of denoising steps.

``estimator="meanfield"`` is the d1 / diffu-GRPO baseline on the same samples: one row per
trajectory with the whole completion masked (and a fraction of the prompt), scored in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles_core.algo.loss import ADPOLoss
from miles_core.config import ADPOConfig
from miles_core.models.lora import reference_policy, trainable_parameters
from miles_core.samplers.step import denoise_step, left_pad, rebuild_state
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

if TYPE_CHECKING:
    from miles_core.distributed import World


@dataclass
class Rows:
    """Training rows. traj/step/weight [R]; commit [R, L] set at scoring time."""

    traj: Tensor
    step: Tensor
    weight: Tensor


def build_rows(batch: TrajectoryBatch, step_fraction: float, generator: torch.Generator) -> Rows:
    """All (b, k) rows, or a random fraction rho of each trajectory's steps reweighted by K_b/m_b
    so that the subsampled objective is unbiased for the full one."""
    trajs, steps, weights = [], [], []
    for b, k_b in enumerate(batch.num_steps.tolist()):
        m_b = k_b if step_fraction >= 1.0 else max(1, math.ceil(step_fraction * k_b))
        chosen = torch.randperm(k_b, generator=generator)[:m_b] if m_b < k_b else torch.arange(k_b)
        trajs.append(torch.full((m_b,), b))
        steps.append(chosen.sort().values)
        weights.append(torch.full((m_b,), k_b / m_b))
    return Rows(torch.cat(trajs), torch.cat(steps), torch.cat(weights))


def row_inputs(batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, estimator: str,
               prompt_mask: Tensor | None = None) -> tuple[Tensor, Tensor, int, Tensor]:
    """-> x [R, T], attn [R, T], prompt width, commit [R, L] for the given rows."""
    prompt, real = left_pad([batch.prompt_ids[i] for i in traj.tolist()], tok.pad_id)
    comp = batch.completion_ids[traj]
    if estimator == "adpo":
        state = rebuild_state(comp, batch.step_map[traj], step, tok.mask_id)
        commit = batch.step_map[traj] == step[:, None]
    else:  # meanfield: everything masked, every token scored at once
        state = torch.full_like(comp, tok.mask_id)
        commit = torch.ones_like(comp, dtype=torch.bool)
        if prompt_mask is not None:
            pm = prompt_mask[traj][:, -prompt.shape[1]:] & real
            prompt = prompt.masked_fill(pm, tok.mask_id)
    x = torch.cat([prompt, state], dim=1)
    attn = torch.cat([real, torch.ones_like(state, dtype=torch.bool)], dim=1)
    return x, attn, prompt.shape[1], commit


def score_rows(model, batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, temperature: float,
               estimator: str = "adpo", prompt_mask: Tensor | None = None):
    """Current-policy log-probs of the committed tokens of each row: logp, entropy, commit [R, L]."""
    x, attn, width, commit = row_inputs(batch, traj, step, tok, estimator, prompt_mask)
    out = denoise_step(model, x, attn, width, temperature=temperature, forbidden=tok.forbidden_ids,
                       tokens=batch.completion_ids[traj])
    return out.logp, out.entropy, commit


def adpo_update(model, optimizer: torch.optim.Optimizer, batch: TrajectoryBatch, cfg: ADPOConfig,
                tok: CharTokenizer, temperature: float, generator: torch.Generator,
                scheduler=None, world: "World | None" = None) -> dict[str, float]:
    """One policy update (``num_minibatches`` x ``epochs`` optimizer steps) on ``batch``.

    ``world`` (data parallel, miles_core/distributed.py): every rank holds the same batch and
    generator state, so rows, permutation and the normaliser are identical everywhere; each rank
    scores only ``world.shard`` of every minibatch, and gradients (and stats) are summed over
    ranks before clipping and the optimizer step. ``None``: single process, unchanged.
    """
    assert batch.advantage is not None
    adv_all = torch.nan_to_num(batch.advantage, nan=0.0)
    keep = (adv_all != 0).nonzero().squeeze(1) if cfg.skip_zero_variance else torch.arange(len(batch))
    stats: dict[str, float] = {"rows": 0.0, "trajectories": float(keep.numel()),
                               "skipped_trajectories": float(len(batch) - keep.numel())}
    if keep.numel() == 0:
        return stats
    sub = batch.select(keep)
    adv = torch.nan_to_num(sub.advantage, nan=0.0)
    if cfg.estimator == "adpo":
        rows = build_rows(sub, cfg.step_fraction, generator)
        behav_full = sub.logp
    else:
        rows = Rows(torch.arange(len(sub)), torch.zeros(len(sub), dtype=torch.long), torch.ones(len(sub)))
        behav_full = None
    prompt_width = max(len(p) for p in sub.prompt_ids)
    prompt_mask = torch.rand(len(sub), prompt_width, generator=generator) < cfg.prompt_mask_prob
    n_rows = rows.traj.numel()
    # "informative": / tokens of the rows that carry signal, so a batch where one group of sixteen
    # had a reward spread still takes a full-size step on its 8 samples; "batch": / tokens of the
    # whole batch (a constant, as in Dr. GRPO), so the step scales with how much of it is signal.
    normaliser = float((len(sub) if cfg.loss_norm == "informative" else len(batch)) * sub.completion_len)
    loss_fn = ADPOLoss(cfg.clip_eps, cfg.is_cap, cfg.kl_coef, cfg.entropy_floor, cfg.entropy_coef)
    params = trainable_parameters(model)
    own = world.shard if world is not None else (lambda idx: idx)

    def chunks(idx: Tensor):
        for s in range(0, idx.numel(), cfg.row_chunk):
            yield idx[s:s + cfg.row_chunk]

    prox = None
    if cfg.num_minibatches * cfg.epochs > 1:  # pi_prox = policy before this update, frozen
        prox = torch.zeros(n_rows, sub.completion_len)
        with torch.no_grad():
            for c in chunks(own(torch.arange(n_rows))):
                prox[c] = score_rows(model, sub, rows.traj[c], rows.step[c], tok, temperature,
                                     cfg.estimator, prompt_mask)[0]
        if world is not None:  # each rank scored its own rows, zeros elsewhere: the sum is exact
            world.all_reduce_(prox)
    agg: dict[str, float] = {}
    total_tok = 0.0
    model.train()
    for _ in range(cfg.epochs):
        perm = torch.randperm(n_rows, generator=generator)
        for mb in perm.chunk(cfg.num_minibatches):
            optimizer.zero_grad(set_to_none=True)
            for c in chunks(own(mb)):
                t_idx, s_idx = rows.traj[c], rows.step[c]
                logp, ent, commit = score_rows(model, sub, t_idx, s_idx, tok, temperature, cfg.estimator, prompt_mask)
                prox_c = prox[c] if prox is not None else logp.detach()
                behav = behav_full[t_idx] if behav_full is not None else prox_c
                ref = None
                if cfg.kl_coef > 0:
                    with torch.no_grad(), reference_policy(model) as ref_model:
                        ref = score_rows(ref_model, sub, t_idx, s_idx, tok, temperature, cfg.estimator, prompt_mask)[0]
                out = loss_fn(logp, prox_c, behav, adv[t_idx], commit, rows.weight[c],
                              normaliser / cfg.num_minibatches, ref, ent)
                out.loss.backward()  # graph of this chunk only: one denoising step per row
                n = out.stats["tokens"]
                total_tok += n
                for k, v in out.stats.items():
                    if k == "iw_max":
                        agg[k] = max(agg.get(k, 0.0), v)
                    elif k != "tokens":
                        agg[k] = agg.get(k, 0.0) + v * n
                agg["loss"] = agg.get("loss", 0.0) + float(out.loss.detach())
            if world is not None:
                world.sync_grads(params)  # sum over ranks: the loss is already / global normaliser
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            agg["grad_norm"] = float(gn)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    if world is not None:
        agg, total_tok = world.reduce_stats(agg, total_tok)
    for k in list(agg):
        if k not in ("iw_max", "loss", "grad_norm"):
            agg[k] /= max(total_tok, 1.0)
    stats.update(agg)
    stats["rows"] = float(n_rows)
    stats["tokens"] = total_tok
    return stats
