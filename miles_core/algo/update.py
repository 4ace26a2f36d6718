"""One ADPO policy update over a batch of recorded trajectories: the one update engine.

:func:`policy_update` is the loop every path runs (synchronous and asynchronous learners, the
torchrun learner with a ``World``, the continuous trainer): proximal log-probs, epochs x
minibatches x row chunks, the ADPO loss, gradient sync, clipping, the optimizer and LR steps, and
the stats. What differs between kinds of trajectory is only how a row is scored, behind a
:class:`RowScorer`. See ARCHITECTURE.md.

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
from typing import Any, Protocol

import torch
from torch import Tensor

from miles_core.algo.advantages import wd1_weights
from miles_core.algo.loss import SUM_KEYS, ADPOLoss
from miles_core.config import ADPOConfig
from miles_core.models.lora import reference_policy, trainable_parameters
from miles_core.parallel import World
from miles_core.samplers.step import left_pad, rebuild_state, step_from_logits
from miles_core.window import head_weight, model_device, window_logits
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch

@dataclass
class Rows:
    """Training rows. traj/step/weight [R]; commit [R, L] set at scoring time."""

    traj: Tensor
    step: Tensor
    weight: Tensor


def build_rows(batch: TrajectoryBatch, step_fraction: float, generator: torch.Generator, merge: int = 1) -> Rows:
    """All (b, k) rows, or a random fraction rho of each trajectory's steps reweighted by K_b/m_b
    so that the subsampled objective is unbiased for the full one. ``merge`` = s > 1: a row is a
    group of s consecutive steps (ceil(K_b / s) rows per trajectory)."""
    trajs, steps, weights = [], [], []
    for b, k_b in enumerate((-(-batch.num_steps // merge)).tolist()):
        m_b = k_b if step_fraction >= 1.0 else max(1, math.ceil(step_fraction * k_b))
        chosen = torch.randperm(k_b, generator=generator)[:m_b] if m_b < k_b else torch.arange(k_b)
        trajs.append(torch.full((m_b,), b))
        steps.append(chosen.sort().values)
        weights.append(torch.full((m_b,), k_b / m_b))
    return Rows(torch.cat(trajs), torch.cat(steps), torch.cat(weights))


def step_commits(step_map: Tensor, step: Tensor, merge: int = 1) -> Tensor:
    """[R, L] the positions row (b, g) scores: committed at steps merge*g .. merge*g + merge - 1."""
    first = (step * merge)[:, None]
    return (step_map >= first) & (step_map < first + merge)


def row_inputs(batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, estimator: str,
               prompt_mask: Tensor | None = None, comp_mask: Tensor | None = None,
               merge: int = 1) -> tuple[Tensor, Tensor, int, Tensor]:
    """-> x [R, T], attn [R, T], prompt width, commit [R, L] for the given rows.

    ``adpo``: the recorded state before step k (rebuilt from ``step_map``), scoring the tokens
    committed at k (``merge`` = s: row g is the state before step s*g, scoring the tokens of steps
    s*g .. s*g + s - 1 at once, TraceRL's shrinkage). ``meanfield``: the whole completion masked, every token scored, prompt tokens
    masked where ``prompt_mask`` [R, P] says (right-aligned). ``coupled``: the completion masked
    where ``comp_mask`` [R, L] says, each row scoring the tokens it masks.
    """
    prompt, real = left_pad([batch.prompt_ids[i] for i in traj.tolist()], tok.pad_id)
    comp = batch.completion_ids[traj]
    if estimator == "adpo":  # merge = s: the state before step s*g, scoring steps s*g .. s*g + s - 1
        state = rebuild_state(comp, batch.step_map[traj], step * merge, tok.mask_id)
        commit = step_commits(batch.step_map[traj], step, merge)
    elif estimator == "coupled":
        assert comp_mask is not None, "coupled rows need their completion mask"
        commit = comp_mask
        state = comp.masked_fill(commit, tok.mask_id)
    else:  # meanfield: everything masked, every token scored at once
        state = torch.full_like(comp, tok.mask_id)
        commit = torch.ones_like(comp, dtype=torch.bool)
        if prompt_mask is not None:
            prompt = prompt.masked_fill(prompt_mask[:, -prompt.shape[1]:] & real, tok.mask_id)
    x = torch.cat([prompt, state], dim=1)
    attn = torch.cat([real, torch.ones_like(state, dtype=torch.bool)], dim=1)
    return x, attn, prompt.shape[1], commit


def score_rows(model, batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, temperature: float,
               estimator: str = "adpo", prompt_mask: Tensor | None = None, comp_mask: Tensor | None = None,
               merge: int = 1):
    """Current-policy log-probs of the committed tokens of each row: logp, entropy, commit [R, L].

    Logits are computed at the committed positions only (an ADPO row commits a few of L tokens; at
    a 126k vocabulary the whole completion's logits are the update's largest tensor): the n
    positions of the widest row, other rows padded with uncommitted positions that are masked."""
    x, attn, width, commit = row_inputs(batch, traj, step, tok, estimator, prompt_mask, comp_mask, merge)
    n = max(int(commit.sum(1).max()), 1)                                    # the chunk's one host read
    order = commit.long().argsort(dim=1, descending=True, stable=True)[:, :n]         # [R, n] committed first
    take = commit.gather(1, order)
    dev = model_device(model)
    logits, _ = window_logits(model, x, attn, (0, x.shape[1]), (order + width).to(dev))   # [R, n, V]
    out = step_from_logits(logits, temperature=temperature, forbidden=tok.forbidden_ids,
                           tokens=batch.completion_ids[traj].gather(1, order).to(dev))
    zeros = torch.zeros(commit.shape, device=out.logp.device)
    order, take = order.to(dev), take.to(dev)
    logp = zeros.scatter(1, order, torch.where(take, out.logp, 0.0))                    # [R, L]
    ent = zeros.scatter(1, order, torch.where(take, out.entropy, 0.0))
    return logp, ent, commit.to(dev)  # all three where the loss runs: the model's device


class RowScorer(Protocol):
    """What the engine needs from one kind of recorded trajectory: masked-diffusion step rows
    (:class:`MaskedStepRows`), continuous Gaussian step rows (continuous/train.py)."""

    width: int  # L: scored positions per row (completion length, or 1 for a continuous step)

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Current-policy log-probs [R, L], entropy [R, L] or None, commit mask [R, L] of rows (traj, step)."""
        ...

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor | None:
        """The sampling policy's stored log-probs [R, L]; None: rows are on-policy (mu = pi_prox)."""
        ...


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scorer: RowScorer, rows: Rows, adv: Tensor,
                  normaliser: float, cfg: ADPOConfig, generator: torch.Generator, scheduler: Any = None,
                  world: World | None = None) -> dict[str, float]:
    """The one update engine: ``num_minibatches`` x ``epochs`` optimizer steps over ``rows``.

    ``adv`` [B] is indexed by ``rows.traj``; ``normaliser`` is fixed for the update, so chunked
    backward passes (``row_chunk`` rows each, or as many as ``chunk_tokens`` positions allow) add up to
    the full-batch gradient. ``world`` (data
    parallel): every rank holds the same rows and generator state and scores only ``world.shard``
    of every minibatch; gradients are summed over ranks before clipping and the step. Stats stay
    tensors (sums and counts) until one reduction and one host read at the end.
    """
    n_rows = rows.traj.numel()
    loss_fn = ADPOLoss(cfg.clip_eps, cfg.is_cap, cfg.kl_coef, cfg.entropy_floor, cfg.entropy_coef,
                       ratio_free=cfg.estimator == "wd1")
    params = trainable_parameters(model)
    device = params[0].device if params else torch.device("cpu")
    own = world.shard if world is not None else (lambda idx: idx)

    # adpo.chunk_tokens: a memory budget in positions per forward/backward. A row costs its sequence
    # positions plus its scored positions weighted by what their logits hold (window.head_weight), so
    # a chunk's activations are the same size whatever K, the prompt and the completion lengths.
    cost = scorer.row_cost(rows.traj, rows.step, head_weight(model)) if cfg.chunk_tokens > 0 and \
        hasattr(scorer, "row_cost") else None

    def chunks(idx: Tensor):
        if cost is None:
            for s in range(0, idx.numel(), cfg.row_chunk):
                yield idx[s:s + cfg.row_chunk]
            return
        c = cost[idx]
        group = ((c.cumsum(0) - c) // cfg.chunk_tokens).long()           # rows starting in one budget
        for g in group.unique_consecutive().tolist():
            yield idx[group == g]

    per_epoch = getattr(scorer, "per_epoch", False)  # rows redrawn each epoch (fresh masks)
    proxes: list[Tensor] = []
    if cfg.num_minibatches * cfg.epochs > 1:  # pi_prox = policy before this update, frozen
        for e in range(cfg.epochs if per_epoch else 1):
            if per_epoch:
                scorer.set_epoch(e)
            prox = torch.zeros(n_rows, scorer.width, device=device)
            with torch.no_grad():
                for c in chunks(own(torch.arange(n_rows))):
                    prox[c] = scorer.score(model, rows.traj[c], rows.step[c])[0].to(device)
            if world is not None:  # each rank scored its own rows, zeros elsewhere: the sum is exact
                world.all_reduce_(prox)
            proxes.append(prox)
    zero = torch.zeros((), device=device)
    sums = {k: zero.clone() for k in (*SUM_KEYS, "tokens", "loss")}
    iw_max, grad_norm = zero.clone(), zero.clone()
    model.train()
    for epoch in range(cfg.epochs):
        if per_epoch:
            scorer.set_epoch(epoch)
        prox = proxes[epoch if per_epoch else 0] if proxes else None
        perm = torch.randperm(n_rows, generator=generator)
        for mb in perm.chunk(cfg.num_minibatches):
            optimizer.zero_grad(set_to_none=True)
            for c in chunks(own(mb)):
                t_idx, s_idx = rows.traj[c], rows.step[c]
                logp, ent, commit = scorer.score(model, t_idx, s_idx)
                prox_c = prox[c] if prox is not None else logp.detach()
                behav = scorer.behaviour(t_idx, s_idx)
                ref = None
                if cfg.kl_coef > 0:
                    with torch.no_grad(), reference_policy(model) as ref_model:
                        ref = scorer.score(ref_model, t_idx, s_idx)[0]
                out = loss_fn(logp, prox_c, prox_c if behav is None else behav.to(logp.device), adv[t_idx].to(logp.device),
                              commit, rows.weight[c].to(logp.device), normaliser / cfg.num_minibatches, ref, ent)
                out.loss.backward()  # graph of this chunk only: one denoising step per row
                for k in SUM_KEYS + ("tokens",):
                    sums[k] += out.sums[k].to(device)
                sums["loss"] += out.loss.detach().to(device)
                iw_max = torch.maximum(iw_max, out.sums["iw_max"].to(device))
            if world is not None:
                world.sync_grads(params)  # sum over ranks: the loss is already / global normaliser
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).to(device)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    total = torch.stack([sums[k] for k in (*SUM_KEYS, "tokens", "loss")])
    peaks = torch.stack([iw_max, grad_norm])
    if world is not None:  # one sum and one max over ranks for every stat of the update
        world.all_reduce_(total)
        world.all_reduce_(peaks, op="max")
    vals, (iw_peak, gn) = total.tolist(), peaks.tolist()  # the update's one host read of its stats
    tokens = vals[len(SUM_KEYS)]
    stats = {k: v / max(tokens, 1.0) for k, v in zip(SUM_KEYS, vals)}
    stats.update(iw_max=iw_peak, grad_norm=gn, loss=vals[-1], tokens=tokens, rows=float(n_rows))
    return stats


@dataclass
class MaskedStepRows:
    """Rows of a masked-diffusion batch for the engine, one estimator each:

    * ``adpo``: every recorded step (b, k), its state rebuilt from ``step_map``, scoring the
      tokens committed at k against their stored behaviour log-probs (the recorded trajectory).
      ``adpo.step_merge`` = s > 1 is TraceRL's shrinkage (Wang et al., 2025, arXiv:2509.06949):
      s consecutive steps form one row scored at the first one's state, s times fewer forwards.
    * ``meanfield``: d1 / diffu-GRPO (Zhao et al., 2025, arXiv:2504.12216): one row per
      trajectory, the completion fully masked and a random fraction ``adpo.prompt_mask_prob`` of
      the prompt masked, every token scored in one pass; a fresh prompt mask at every inner
      iteration (epoch), as d1 draws one per iteration; ``adpo.mask_samples`` draws per trajectory.
    * ``wd1`` (set up in :func:`adpo_update`): d1's rows, each trajectory weighted by
      softmax(A) - softmax(-A) in its group, with a ratio-free loss -w log p (arXiv:2507.08838).
    * ``coupled``: DiffuCoder's coupled-GRPO (Gong et al., 2025, arXiv:2506.20639): two rows per
      trajectory, a random mask M (each token masked with probability t ~ U(0, 1)) and its
      complement, so every completion token is scored exactly once per pair; redrawn every epoch,
      ``adpo.mask_samples`` pairs per trajectory.

    ``meanfield`` and ``coupled`` score tokens outside any recorded state, so their ratio is
    against the policy before the update and there is no importance weight (behaviour = prox).
    """

    batch: TrajectoryBatch
    tok: CharTokenizer
    temperature: float
    estimator: str
    prompt_masks: Tensor | None = None  # [E, n, B, P]: meanfield's n prompt masks per epoch
    comp_masks: Tensor | None = None    # [E, n, B, L]: coupled's n masks M per epoch (each pair: M, ~M)
    merge: int = 1                      # adpo: s steps per row (adpo.step_merge)
    epoch: int = 0

    @property
    def width(self) -> int:
        return self.batch.completion_len

    @property
    def seq_len(self) -> int:
        """Positions of one row's forward: the longest prompt plus the completion."""
        return max(len(p) for p in self.batch.prompt_ids) + self.batch.completion_len

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] memory of each row in positions: its forward's plus ``head`` per scored position."""
        if self.estimator == "adpo":
            scored = step_commits(self.batch.step_map[traj], step, self.merge).sum(1)
        elif self.estimator == "coupled":  # a mask and its complement: half the completion on average
            scored = torch.full_like(traj, self.batch.completion_len // 2)
        else:
            scored = torch.full_like(traj, self.batch.completion_len)
        return self.seq_len + head * scored.float()

    @property
    def per_epoch(self) -> bool:
        """Rows change between epochs (fresh masks), so the proximal policy is scored per epoch."""
        return self.estimator != "adpo"

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def masks(self, traj: Tensor, step: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """This epoch's prompt mask [R, P] and completion mask [R, L] of rows (traj, step): a
        meanfield row's step is its mask sample; a coupled row's is 2 x sample + (0: M, 1: ~M)."""
        pm = self.prompt_masks[self.epoch][step, traj] if self.prompt_masks is not None else None
        cm = None
        if self.comp_masks is not None:
            cm = self.comp_masks[self.epoch][step // 2, traj] ^ (step % 2 == 1)[:, None]
        return pm, cm

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        pm, cm = self.masks(traj, step)
        return score_rows(model, self.batch, traj, step, self.tok, self.temperature, self.estimator, pm, cm,
                          self.merge)

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor | None:
        """The recorded mu of each token; a merged row (s > 1) scores tokens at an earlier state than
        the one they were sampled from, so its ratio is against the proximal policy (TraceRL)."""
        return self.batch.logp[traj] if self.estimator == "adpo" and self.merge == 1 else None


def estimator_rows(sub: TrajectoryBatch, cfg: ADPOConfig, tok: CharTokenizer, temperature: float,
                   generator: torch.Generator) -> tuple[Rows, MaskedStepRows]:
    """The rows of ``cfg.estimator`` on the kept trajectories, and the scorer that scores them.
    Random draws happen here, in a fixed order, so every rank of a world draws the same."""
    b, epochs = len(sub), cfg.epochs
    prompt_width = max(len(p) for p in sub.prompt_ids)
    if cfg.estimator == "adpo":
        rows = build_rows(sub, cfg.step_fraction, generator, cfg.step_merge)
        torch.rand(b, prompt_width, generator=generator)  # keeps ADPO's random stream as it always was
        return rows, MaskedStepRows(sub, tok, temperature, "adpo", merge=cfg.step_merge)
    n = cfg.mask_samples  # Monte-Carlo mask draws per trajectory, each row weighted 1/n
    if cfg.estimator in ("meanfield", "wd1"):  # wd1 scores d1's rows; its weights and loss differ
        rows = Rows(torch.arange(b).repeat_interleave(n), torch.arange(n).repeat(b), torch.full((b * n,), 1 / n))
        masks = torch.rand(epochs, n, b, prompt_width, generator=generator) < cfg.prompt_mask_prob
        return rows, MaskedStepRows(sub, tok, temperature, "meanfield", prompt_masks=masks)
    t = torch.rand(epochs, n, b, 1, generator=generator)
    comp = torch.rand(epochs, n, b, sub.completion_len, generator=generator) < t
    rows = Rows(torch.arange(b).repeat_interleave(2 * n), torch.arange(2 * n).repeat(b), torch.full((2 * b * n,), 1 / n))
    return rows, MaskedStepRows(sub, tok, temperature, "coupled", comp_masks=comp)


def adpo_update(model: Any, optimizer: torch.optim.Optimizer, batch: TrajectoryBatch, cfg: ADPOConfig,
                tok: CharTokenizer, temperature: float, generator: torch.Generator,
                scheduler: Any = None, world: World | None = None) -> dict[str, float]:
    """One policy update on a masked-diffusion ``batch`` (see :func:`policy_update` for ``world``):
    rows of the trajectories with a non-zero advantage, their loss normaliser, then the engine."""
    assert batch.advantage is not None
    adv_all = torch.nan_to_num(batch.advantage, nan=0.0)
    keep = (adv_all != 0).nonzero().squeeze(1) if cfg.skip_zero_variance else torch.arange(len(batch))
    stats: dict[str, float] = {"rows": 0.0, "trajectories": float(keep.numel()),
                               "skipped_trajectories": float(len(batch) - keep.numel())}
    if keep.numel() == 0:
        return stats
    sub = batch.select(keep)
    rows, scorer = estimator_rows(sub, cfg, tok, temperature, generator)
    # "informative": / tokens of the rows that carry signal, so a batch where one group of sixteen
    # had a reward spread still takes a full-size step on its 8 samples; "batch": / tokens of the
    # whole batch (a constant, as in Dr. GRPO), so the step scales with how much of it is signal.
    normaliser = float((len(sub) if cfg.loss_norm == "informative" else len(batch)) * sub.completion_len)
    adv = torch.nan_to_num(sub.advantage, nan=0.0)
    if cfg.estimator == "wd1":  # ratio-free weighted likelihood: softmax(A) - softmax(-A) per group
        adv = wd1_weights(adv, sub.group_id)
    stats.update(policy_update(model, optimizer, scorer, rows, adv, normaliser, cfg, generator, scheduler, world))
    return stats
