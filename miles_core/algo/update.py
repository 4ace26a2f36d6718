"""One ADPO policy update over a batch of recorded trajectories: the one update engine.

:func:`update_on_rows` is the loop every path runs (synchronous and asynchronous learners, the
torchrun learner with a ``World``, the continuous trainer), top down: proximal log-probs, then
epochs x minibatches x row chunks (score, loss, backward), clipping, the optimizer and LR steps,
and the stats. What data-parallel ranks add (gradient sums, FSDP's padding passes) is one object,
:class:`~miles_core.algo.ranks.Ranks`, that a process alone never builds. What differs between
kinds of trajectory is only how a row is scored, behind a :class:`~miles_core.algo.rows.RowScorer`;
what differs between estimators (what a row is, the loss, the advantage transform) is looked up by
``update.estimator`` in the registry, :mod:`miles_core.algo.estimators`, so nothing here names
one. See ARCHITECTURE.md.

Every recorded step is an independent row (trajectory b, step k): its state is rebuilt from
``step_map``, scored with the same step function that sampled it, and backpropagated on its own
(chunks of ``row_chunk`` rows). Nothing is ever backpropagated through the denoising chain, so
peak memory depends on the chunk size, not on the number of denoising steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.draws import Draws, minibatches
from miles_core.algo.estimators import get_estimator
from miles_core.algo.loss import SUM_KEYS
from miles_core.algo.ranks import Ranks
from miles_core.algo.rows import NoRows, Rows, RowScorer, no_rows
from miles_core.config import UpdateConfig
from miles_core.models.lora import reference_policy, trainable_parameters
from miles_core.parallel import World
from miles_core.tokenizer import CharTokenizer
from miles_core.types import Batch, TrajectoryBatch
from miles_core.models.window import capabilities

__all__ = ["ChunkPlan", "Draws", "RowScorer", "UpdateRows", "UpdateStats", "update_policy", "deterministic_forward",
           "update_on_rows", "proximal_logprobs"]


@dataclass
class UpdateRows:
    """What one update learns from: the rows, how they are scored, and per trajectory its
    advantage and random draws. ``adv`` [B] is indexed by ``rows.traj``; ``normaliser`` (tokens)
    is the whole global batch's, fixed for the update, so chunked backward passes add up to the
    full-batch gradient; ``draws`` deal each row to a minibatch (algo/draws.py); ``fresh`` [B]:
    trajectories sampled by the weights this update starts from (their pi_prox is their mu)."""

    scorer: RowScorer
    rows: Rows
    adv: Tensor
    normaliser: float
    draws: Draws
    fresh: Tensor | None = None


class ChunkPlan:
    """Which of ``rows`` each forward/backward carries. ``update.chunk_tokens`` > 0 is a memory
    budget in positions per forward/backward (a row costs its sequence plus its scored positions
    weighted by what their logits hold, ``Capabilities.head_weight``, so a chunk's activations are
    the same size whatever K and the lengths); otherwise chunks of ``update.row_chunk`` rows."""

    def __init__(self, model: Any, scorer: RowScorer, rows: Rows, cfg: UpdateConfig) -> None:
        self.row_chunk, self.budget = cfg.row_chunk, cfg.chunk_tokens
        self.cost = scorer.row_cost(rows.traj, rows.step, capabilities(model).head_weight) if self.budget > 0 else None

    def chunks(self, idx: Tensor) -> list[Tensor]:
        if self.cost is None:
            return [idx[s:s + self.row_chunk] for s in range(0, idx.numel(), self.row_chunk)]
        c = self.cost[idx]
        group = ((c.cumsum(0) - c) // self.budget).long()                     # rows starting in one budget
        return [idx[group == g] for g in group.unique_consecutive().tolist()]


def proximal_logprobs(model: Any, u: UpdateRows, plan: ChunkPlan, cfg: UpdateConfig, first: Tensor,
                      mu_all: Tensor | None, device: torch.device, ranks: Ranks | None = None) -> list[Tensor]:
    """pi_prox [R, L] per epoch (one for all epochs unless ``scorer.per_epoch``): the policy
    before this update, frozen, scored by a no-grad pass only where it is not known. The
    ``first`` minibatch's rows take it from their own forward in the update (the weights have not
    stepped yet); rows of a ``fresh`` trajectory whose every token has a recorded mu take mu (the
    sampler ran the same step function on the same weights). Empty when one optimizer step is all
    the update takes (pi_prox is then the forward's own log-probs). Each rank scores its own rows
    only: nothing here is exchanged."""
    rows, scorer = u.rows, u.scorer
    n_rows = rows.traj.numel()
    if cfg.num_minibatches * cfg.epochs <= 1:
        return []
    own_pass = torch.ones(n_rows, dtype=torch.bool)
    own_pass[first] = False
    by_mu = torch.zeros_like(own_pass)   # rows sampled by these very weights with every token's mu recorded
    if u.fresh is not None and mu_all is not None:
        by_mu = u.fresh[rows.traj].cpu() & ~mu_all.isnan().any(1).cpu()
    own_pass &= ~by_mu
    proxes = []
    for e in range(cfg.epochs if scorer.per_epoch else 1):
        if scorer.per_epoch:
            scorer.set_epoch(e)
        prox = torch.zeros(n_rows, scorer.width, device=device)
        cs = plan.chunks(torch.arange(n_rows)[own_pass] if e == 0 else torch.arange(n_rows))
        with torch.no_grad():
            for c in cs if ranks is None else ranks.chunks(model, cs, backward=False):
                prox[c] = scorer.score(model, rows.traj[c], rows.step[c])[0].to(device)
        if by_mu.any():
            prox[by_mu.to(device)] = mu_all[by_mu.to(mu_all.device)].to(device, prox.dtype)
        proxes.append(prox)
    return proxes


class UpdateStats:
    """Phase 4's inputs, kept as tensors on the device (sums and counts, the peaks) until one
    reduction over ranks and one host read at the end of the update."""

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), device=device)
        self.sums = {k: zero.clone() for k in (*SUM_KEYS, "tokens", "loss")}
        self.iw_max, self.grad_norm, self.device = zero.clone(), zero.clone(), device

    def add(self, out: Any) -> None:
        for k in SUM_KEYS + ("tokens",):
            self.sums[k] += out.sums[k].to(self.device)
        self.sums["loss"] += out.loss.detach().to(self.device)
        self.iw_max = torch.maximum(self.iw_max, out.sums["iw_max"].to(self.device))

    def reduce(self, world: World | None, n_rows: int) -> dict[str, float]:
        """Phase 4: one sum and one max over ranks, one host read; per-token means. ``n_rows``:
        this rank's rows (the stats report the update's, summed)."""
        rows = torch.tensor(float(n_rows), device=self.device)
        total = torch.stack([self.sums[k] for k in (*SUM_KEYS, "tokens", "loss")] + [rows])
        peaks = torch.stack([self.iw_max, self.grad_norm])
        if world is not None:
            world.all_reduce_(total)
            world.all_reduce_(peaks, op="max")
        vals, (iw_peak, gn) = total.tolist(), peaks.tolist()  # the update's one host read of its stats
        tokens = vals[len(SUM_KEYS)]
        stats = {k: v / max(tokens, 1.0) for k, v in zip(SUM_KEYS, vals)}
        stats.update(iw_max=iw_peak, grad_norm=gn, loss=vals[-2], tokens=tokens, rows=vals[-1])
        return stats


def update_on_rows(model: Any, optimizer: torch.optim.Optimizer, u: UpdateRows, cfg: UpdateConfig,
                   scheduler: Any = None, ranks: Ranks | None = None) -> dict[str, float]:
    """The one update engine: ``num_minibatches`` x ``epochs`` optimizer steps over ``u.rows``.
    Each row (a recorded denoising step, or an estimator's masked copy) is scored on its own, so
    nothing is backpropagated through the chain and memory follows the chunk, not K.

    ``ranks`` (data parallel, algo/ranks.py): ``u.rows`` are the rows of the trajectories this rank
    holds; gradients are summed over ranks before clipping. No draw depends on other ranks'
    trajectories, so the D ranks together make one process's update of the whole batch."""
    rows, scorer = u.rows, u.scorer
    loss_fn = get_estimator(cfg.estimator).loss(cfg)
    params = trainable_parameters(model)
    device = params[0].device if params else torch.device("cpu")
    plan = ChunkPlan(model, scorer, rows, cfg)
    before = None if ranks is None or cfg.num_minibatches == 1 else ranks.rows_before(rows.traj, u.draws)
    batches = [minibatches(rows.traj, u.draws, cfg.num_minibatches, e, before) for e in range(cfg.epochs)]
    # the first minibatch's forward runs on exactly the weights before the update: exact only for a
    # deterministic forward (with active dropout every row gets its own no-grad pass)
    first = batches[0][0] if deterministic_forward(model) else rows.traj[:0]
    mu_all = scorer.behaviour(rows.traj, rows.step)  # [R, L] recorded mu (NaN: none); None: on-policy rows
    proxes = proximal_logprobs(model, u, plan, cfg, first, mu_all, device, ranks)
    scale = 1.0 if ranks is None else ranks.loss_scale
    stats = UpdateStats(device)
    model.train()
    for epoch in range(cfg.epochs):
        if scorer.per_epoch:
            scorer.set_epoch(epoch)
        prox = proxes[epoch if scorer.per_epoch else 0] if proxes else None
        for i_mb, mb in enumerate(batches[epoch]):
            from_forward = prox is None or (epoch == 0 and i_mb == 0 and first.numel() > 0)
            optimizer.zero_grad(set_to_none=True)
            cs = plan.chunks(mb)
            for c in cs if ranks is None else ranks.chunks(model, cs, backward=True):
                out = chunk_loss(model, u, c, loss_fn, prox, from_forward, mu_all, cfg)
                (out.loss * scale).backward()
                stats.add(out)
            if ranks is not None:
                ranks.sum_grads(params)  # the loss is already / the global normaliser
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            stats.grad_norm = (norm if ranks is None else ranks.full(norm)).to(device)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return stats.reduce(None if ranks is None else ranks.world, rows.traj.numel())


def chunk_loss(model: Any, u: UpdateRows, c: Tensor, loss_fn: Any, prox: Tensor | None, from_forward: bool,
               mu_all: Tensor | None, cfg: UpdateConfig) -> Any:
    """The loss of rows ``c`` (indices into ``u.rows``): their current log-probs against pi_prox
    (``from_forward``: this forward's own, detached, and written into ``prox`` for later epochs),
    each token's recorded behaviour mu (NaN or none: pi_prox) and, with ``kl_coef``, the reference."""
    t_idx, s_idx = u.rows.traj[c], u.rows.step[c]
    logp, ent, commit = u.scorer.score(model, t_idx, s_idx)
    if from_forward:
        prox_c = logp.detach()
        if prox is not None:  # later epochs of the same rows read it back
            prox[c] = prox_c.to(prox.device)
    else:
        prox_c = prox[c]
    behav = None if mu_all is None else mu_all[c.to(mu_all.device)]
    ref = None
    if cfg.kl_coef > 0:
        with torch.no_grad(), reference_policy(model) as ref_model:
            ref = u.scorer.score(ref_model, t_idx, s_idx)[0]
    mu = prox_c if behav is None else torch.where(behav.isnan(), prox_c, behav.to(logp.device))
    return loss_fn(logp, prox_c, mu, u.adv[t_idx].to(logp.device), commit, u.rows.weight[c].to(logp.device),
                   u.normaliser / cfg.num_minibatches, ref, ent)


def deterministic_forward(model: Any) -> bool:
    """No active dropout: two forwards of the same rows on the same weights give the same log-probs
    (a module's ``nn.Dropout`` with p > 0, or a config's ``*dropout*`` float above 0, says otherwise)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            return False
        conf = getattr(m, "config", None)
        if hasattr(conf, "__dict__") and any("dropout" in k and isinstance(v, float) and v > 0
                                             for k, v in vars(conf).items()):
            return False
    return True


def as_draws(draws: Draws | torch.Generator, n: int) -> Draws:
    """``draws`` as they are, or a generator's: one seed drawn from it, ``n`` trajectories keyed by position."""
    return Draws.positional(draws, n) if isinstance(draws, torch.Generator) else draws


def global_counts(world: World | None, *counts: float) -> list[float]:
    """``counts`` summed over ranks (one all-reduce): what the update needs of the whole batch."""
    t = torch.tensor(counts, dtype=torch.float64)
    if world is not None:
        world.all_reduce_(t)
    return t.tolist()


def update_policy(model: Any, optimizer: torch.optim.Optimizer, batch: Batch, cfg: UpdateConfig,
                  tok: CharTokenizer, temperature: float, draws: Draws | torch.Generator,
                  scheduler: Any = None, world: World | None = None, version: int | None = None,
                  own: Any = None, oldest: int | None = None) -> dict[str, float]:
    """One policy update on a masked-diffusion ``batch``: rows of the trajectories with a non-zero
    advantage, their loss normaliser, then the engine. A renoising batch (DiffusionGemma) has its
    own rows (:func:`~miles_core.algo.renoise_rows.renoise_rows`, built by the estimators that
    declare its kind; its temperature schedule travels with the batch, so ``temperature`` is not
    read for it). ``draws``: the trajectories' keyed draws (a generator: keyed by position, for a
    caller holding one whole batch). ``version``: the policy version the model holds; the
    trajectories it sampled (``batch.policy_version``) have pi_prox = their recorded mu. ``own``:
    the estimator's settings (the recipe's ``estimators[cfg.estimator]``; None: its defaults).
    ``oldest``: rows whose scored tokens were sampled by an adapter older than this version are not
    drawn (the staleness bound, counted per step: with in-flight refresh a trajectory's early steps
    can be older than its late ones; ``stale_rows`` counts them).

    ``world`` (data parallel): ``batch`` is this rank's share (learner/shares.py);
    what the update needs of the whole global batch is two counts (kept trajectories, all
    trajectories), summed over ranks; everything else is per trajectory."""
    assert batch.advantage is not None
    draws = as_draws(draws, len(batch)).with_groups(batch.group_id)
    if len(draws) != len(batch):
        raise ValueError(f"update_policy: {len(draws)} trajectory keys for a batch of {len(batch)}")
    adv_all = torch.nan_to_num(batch.advantage, nan=0.0)
    keep = (adv_all != 0).nonzero().squeeze(1) if cfg.skip_zero_variance else torch.arange(len(batch))
    estimator = get_estimator(cfg.estimator)
    own = estimator.settings() if own is None else own
    sub = batch.select(keep)
    if keep.numel():
        rows, scorer = estimator.rows(sub, own, cfg.epochs, tok, temperature, draws.select(keep), model)
    else:  # no kept trajectory here (maybe on other ranks): this rank joins the collectives with no rows
        rows, scorer = no_rows(), NoRows(batch.completion_len)
    stale = 0
    if oldest is not None and rows.traj.numel():
        live = scorer.versions(rows.traj, rows.step) >= oldest                    # [R]
        stale = int((~live).sum())
        if stale:
            rows = Rows(rows.traj[live], rows.step[live], rows.weight[live], rows.bounds)
    kept, total, n_rows, stale_all = global_counts(world, keep.numel(), len(batch), rows.traj.numel(), stale)
    stats: dict[str, float] = {"rows": 0.0, "trajectories": kept, "skipped_trajectories": total - kept,
                               "stale_rows": stale_all}
    if n_rows == 0:  # no kept trajectory, or renoising rows that all stopped after one step
        return stats
    pad = (scorer, rows)
    if world is not None and world.sharded and rows.traj.numel() == 0:  # FSDP: pad with a row of our own
        one = torch.arange(1)
        source = batch.select(one) if len(batch) else TrajectoryBatch.empty(batch.completion_len, 1, tok.pad_id)
        pad_rows, pad_scorer = estimator.rows(source, own, cfg.epochs, tok, temperature, Draws(draws.seed, one), model)
        pad = (pad_scorer, pad_rows)
    # "informative": / tokens of the rows that carry signal, so a batch where one group of sixteen
    # had a reward spread still takes a full-size step on its 8 samples; "batch": / tokens of the
    # whole batch (a constant, as in Dr. GRPO), so the step scales with how much of it is signal.
    normaliser = float((kept if cfg.loss_norm == "informative" else total) * batch.completion_len)
    adv = estimator.advantages(torch.nan_to_num(sub.advantage, nan=0.0), sub) if keep.numel() else torch.zeros(0)
    fresh = None if version is None else sub.policy_version == version
    u = UpdateRows(scorer, rows, adv, normaliser, draws.select(keep), fresh)
    stats.update(update_on_rows(model, optimizer, u, cfg, scheduler,
                                None if world is None else Ranks(world, pad, cfg.kl_coef)))
    return stats
