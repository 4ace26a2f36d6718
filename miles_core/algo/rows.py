"""Training rows of a masked-diffusion batch and how one is scored: the state a row sees, the
positions it scores, and the current policy's log-probs there (the update engine, algo/update.py,
runs them; the ELBO-based estimators, algo/elbo.py, score several masked copies per row).

Every recorded step is an independent row (trajectory b, step k): its state is rebuilt from
``step_map``, scored with the same step function that sampled it, and backpropagated on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_core.samplers.step import left_pad, rebuild_state, step_from_logits
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch
from miles_core.models.window import model_device, window_logits


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
               merge: int = 1, scored: Tensor | None = None) -> tuple[Tensor, Tensor, int, Tensor]:
    """-> x [R, T], attn [R, T], prompt width, commit [R, L] for the given rows.

    ``adpo``: the recorded state before step k (rebuilt from ``step_map``), scoring the tokens
    committed at k (``merge`` = s: row g is the state before step s*g, scoring the tokens of steps
    s*g .. s*g + s - 1 at once, TraceRL's shrinkage). ``meanfield``: the whole completion masked, every token scored, prompt tokens
    masked where ``prompt_mask`` [R, P] says (right-aligned; any estimator may pass one). ``coupled``
    (and the ELBO copies of algo/elbo.py): the completion masked where ``comp_mask`` [R, L] says,
    each row scoring the tokens it masks, or only those of them in ``scored`` [R, L] (EBPO's block).
    """
    prompt, real = left_pad([batch.prompt_ids[i] for i in traj.tolist()], tok.pad_id)
    comp = batch.completion_ids[traj]
    if estimator == "adpo":  # merge = s: the state before step s*g, scoring steps s*g .. s*g + s - 1
        state = rebuild_state(comp, batch.step_map[traj], step * merge, tok.mask_id)
        commit = step_commits(batch.step_map[traj], step, merge)
    elif estimator == "coupled":
        assert comp_mask is not None, "coupled rows need their completion mask"
        state = comp.masked_fill(comp_mask, tok.mask_id)
        commit = comp_mask if scored is None else comp_mask & scored
    else:  # meanfield: everything masked, every token scored at once
        state = torch.full_like(comp, tok.mask_id)
        commit = torch.ones_like(comp, dtype=torch.bool)
    if prompt_mask is not None:  # meanfield, spg: d1's random prompt masking
        prompt = prompt.masked_fill(prompt_mask[:, -prompt.shape[1]:] & real, tok.mask_id)
    x = torch.cat([prompt, state], dim=1)
    attn = torch.cat([real, torch.ones_like(state, dtype=torch.bool)], dim=1)
    return x, attn, prompt.shape[1], commit


def score_rows(model, batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, temperature: float,
               estimator: str = "adpo", prompt_mask: Tensor | None = None, comp_mask: Tensor | None = None,
               merge: int = 1, scored: Tensor | None = None):
    """Current-policy log-probs of the committed tokens of each row: logp, entropy, commit [R, L].

    Logits are computed at the committed positions only (an ADPO row commits a few of L tokens; at
    a 126k vocabulary the whole completion's logits are the update's largest tensor): the n
    positions of the widest row, other rows padded with uncommitted positions that are masked."""
    x, attn, width, commit = row_inputs(batch, traj, step, tok, estimator, prompt_mask, comp_mask, merge, scored)
    n = max(int(commit.sum(1).max()), 1)                                    # the chunk's one host read
    order = commit.long().argsort(dim=1, descending=True, stable=True)[:, :n]         # [R, n] committed first
    take = commit.gather(1, order)
    dev = model_device(model)
    logits, _ = window_logits(model, x, attn, (0, x.shape[1]), (order + width).to(dev))   # [R, n, V]
    out = step_from_logits(logits, temperature=temperature, forbidden=tok.forbidden_ids,
                           tokens=batch.completion_ids[traj].gather(1, order).to(dev))
    zeros = torch.zeros(commit.shape, device=out.logp.device, dtype=out.logp.dtype)
    order, take = order.to(dev), take.to(dev)
    logp = zeros.scatter(1, order, torch.where(take, out.logp, 0.0))                    # [R, L]
    ent = zeros.scatter(1, order, torch.where(take, out.entropy, 0.0))
    return logp, ent, commit.to(dev)  # all three where the loss runs: the model's device


def seq_len(batch: TrajectoryBatch) -> int:
    """Positions of one row's forward: the longest prompt plus the completion."""
    return max(len(p) for p in batch.prompt_ids) + batch.completion_len


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

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] memory of each row in positions: its forward's plus ``head`` per scored position."""
        if self.estimator == "adpo":
            scored = step_commits(self.batch.step_map[traj], step, self.merge).sum(1)
        elif self.estimator == "coupled":  # a mask and its complement: half the completion on average
            scored = torch.full_like(traj, self.batch.completion_len // 2)
        else:
            scored = torch.full_like(traj, self.batch.completion_len)
        return seq_len(self.batch) + head * scored.float()

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
