"""Training rows of a masked-diffusion batch and how one is scored: the state a row sees, the
positions it scores, and the current policy's log-probs there (the update engine, algo/update.py,
runs them; each estimator, algo/estimators/, picks the kind of row it builds; the ELBO-based ones
score several masked copies per row, algo/elbo.py).

Every recorded step is an independent row (trajectory b, step k): its state is rebuilt from
``step_map``, scored with the same step function that sampled it, and backpropagated on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from miles_core.algo.draws import STREAM_PROMPT, Draws
from miles_core.samplers.step import left_pad, rebuild_state, step_from_logits
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch
from miles_core.models.window import model_device, window_logits


@dataclass
class Rows:
    """Training rows. traj/step/weight [R]; commit [R, L] set at scoring time. ``bounds`` [B, G + 1]
    (recorded-step rows that group steps): row (b, g) covers steps bounds[b, g] .. bounds[b, g + 1] - 1;
    None: row (b, k) is step k alone."""

    traj: Tensor
    step: Tensor
    weight: Tensor
    bounds: Tensor | None = None


def step_commits(step_map: Tensor, first: Tensor, end: Tensor) -> Tensor:
    """[R, L] the positions a row scores: those committed at steps first .. end - 1 ([R] each)."""
    return (step_map >= first[:, None]) & (step_map < end[:, None])


class RowView(Protocol):
    """What state a masked-diffusion row sees and which positions it scores. The estimator modules
    (algo/estimators/) pick one of the kinds below, or bring their own, so nothing here branches
    on an estimator's name."""

    per_epoch: bool  # the rows' masks are redrawn every epoch (the proximal policy is rescored per epoch)

    def state(self, batch: TrajectoryBatch, comp: Tensor, traj: Tensor, step: Tensor, mask_id: int,
              comp_mask: Tensor | None, scored: Tensor | None) -> tuple[Tensor, Tensor]:
        """-> the completion state [R, L] the rows see and their commit [R, L] (positions scored)."""
        ...

    def scored_count(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """[R] positions each row scores (its logits' share of the memory budget)."""
        ...

    def behaviour(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor | None:
        """The sampling policy's log-probs [R, L]; None: rows are on-policy (mu = pi_prox)."""
        ...

    def versions(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """[R] the oldest adapter version behind what each row scores (its staleness is that one's)."""
        ...


class RowScorer(Protocol):
    """What the update engine (algo/update.py) needs from one kind of recorded trajectory:
    masked-diffusion rows (:class:`MaskedStepRows`, algo/elbo.py), renoising chains
    (algo/renoise_rows.py), continuous Gaussian step rows (continuous/train.py). Every member is
    required (the engine probes for none); :class:`FixedRows` gives the ones a scorer whose rows
    never change and that has no memory model can take as they are."""

    width: int  # L: scored positions per row (completion length, or 1 for a continuous step)
    per_epoch: bool  # True: the rows' masks are redrawn each epoch, so pi_prox is scored per epoch

    def set_epoch(self, epoch: int) -> None:
        """Score the masks of ``epoch`` from now on (the engine calls it only when ``per_epoch``)."""
        ...

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor | None:
        """[R] memory of each row in positions (its forwards' plus ``head`` per scored position),
        which ``update.chunk_tokens`` budgets; None: no memory model, chunks of ``update.row_chunk`` rows."""
        ...

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Current-policy log-probs [R, L], entropy [R, L] or None, commit mask [R, L] of rows (traj, step)."""
        ...

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor | None:
        """The sampling policy's stored log-probs [R, L]; None: rows are on-policy (mu = pi_prox);
        NaN where a row has no recorded mu for a token (the engine uses pi_prox there)."""
        ...

    def versions(self, traj: Tensor, step: Tensor) -> Tensor:
        """[R] the oldest adapter version behind each row's scored tokens: the update gives no
        weight to rows older than the staleness bound (a step-level age under in-flight refresh)."""
        ...


class FixedRows:
    """The :class:`RowScorer` members of a scorer whose rows are the same in every epoch and that
    states no memory cost per row (renoising chains, continuous steps): chunks by row count."""

    per_epoch = False

    def set_epoch(self, epoch: int) -> None:
        """Nothing to redraw: the rows are recorded actions."""

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor | None:
        return None

    def versions(self, traj: Tensor, step: Tensor) -> Tensor:
        """A trajectory's rows are as old as it is (these samplers never refresh mid-chain)."""
        return self.batch.policy_version[traj]


class NoRows(FixedRows):
    """The scorer of a data-parallel rank that holds no row of this update (its trajectories all
    carried no advantage, or the batches it would have read were dropped): it scores nothing and
    still takes part in every collective of the update (gradient sums, stats)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        raise RuntimeError("NoRows.score: this rank holds no rows (a padding chunk scores the pad rows)")

    def behaviour(self, traj: Tensor, step: Tensor) -> None:
        return None

    def versions(self, traj: Tensor, step: Tensor) -> Tensor:
        return torch.zeros(0, dtype=torch.long)


def no_rows() -> Rows:
    return Rows(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0))


class RecordedStep:
    """A row is a recorded step (ADPO's row kind): the state before step k, rebuilt from
    ``step_map``, scoring the tokens committed at k. With ``bounds`` (:class:`Rows`) row g of
    trajectory b is a run of steps first .. end - 1 scored at once at the first one's state
    (TraceRL's shrinkage): s times fewer forwards than scoring each of s steps."""

    per_epoch = False  # the recorded states never change: the proximal policy is scored once

    def __init__(self, bounds: Tensor | None = None) -> None:
        self.bounds = bounds

    def span(self, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
        """-> first step [R], end step (exclusive) [R] of each row."""
        if self.bounds is None:
            return step, step + 1
        return self.bounds[traj, step], self.bounds[traj, step + 1]

    def state(self, batch: TrajectoryBatch, comp: Tensor, traj: Tensor, step: Tensor, mask_id: int,
              comp_mask: Tensor | None, scored: Tensor | None) -> tuple[Tensor, Tensor]:
        """-> completion state [R, L], commit [R, L]."""
        first, end = self.span(traj, step)
        return rebuild_state(comp, batch.step_map[traj], first, mask_id), step_commits(batch.step_map[traj], first, end)

    def scored_count(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """[R] positions each row scores."""
        return step_commits(batch.step_map[traj], *self.span(traj, step)).sum(1)

    def behaviour(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor | None:
        """The recorded mu of each token [R, L]. A run of several steps scores its later tokens at an
        earlier state than the one they were sampled from, so there is no recorded mu for them: NaN,
        and the engine takes the proximal policy instead (TraceRL's ratio)."""
        if self.bounds is None:
            return batch.logp[traj]
        first, end = self.span(traj, step)
        return batch.logp[traj].masked_fill((end - first > 1)[:, None], float("nan"))

    def versions(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """[R] the version of the oldest step a row spans: a recorded step is as old as the
        adapter that took it (in-flight refresh: ``TrajectoryBatch.step_version``)."""
        return _oldest(batch, traj, step_commits(batch.step_map[traj], *self.span(traj, step)))


class FullyMasked:
    """A row is the whole completion masked, every token scored in one pass (d1's mean-field row)."""

    per_epoch = True   # its prompt masks are redrawn every epoch

    def state(self, batch: TrajectoryBatch, comp: Tensor, traj: Tensor, step: Tensor, mask_id: int,
              comp_mask: Tensor | None, scored: Tensor | None) -> tuple[Tensor, Tensor]:
        return torch.full_like(comp, mask_id), torch.ones_like(comp, dtype=torch.bool)

    def scored_count(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        return torch.full_like(traj, batch.completion_len)

    def behaviour(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> None:
        return None  # outside any recorded state: no behaviour policy, the ratio is against prox

    def versions(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """The whole completion is scored: as old as the trajectory's oldest step."""
        return batch.policy_version[traj]


class MaskedCopy:
    """A row is a copy of the completion masked where ``comp_mask`` [R, L] says, scoring the tokens
    it masks, or only those of them in ``scored`` [R, L] (EBPO's block): coupled-GRPO's rows and
    the ELBO estimators' copies."""

    per_epoch = True   # its masks are redrawn every epoch

    def state(self, batch: TrajectoryBatch, comp: Tensor, traj: Tensor, step: Tensor, mask_id: int,
              comp_mask: Tensor | None, scored: Tensor | None) -> tuple[Tensor, Tensor]:
        assert comp_mask is not None, "masked-copy rows need their completion mask"
        return comp.masked_fill(comp_mask, mask_id), comp_mask if scored is None else comp_mask & scored

    def scored_count(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """A mask and its complement: half the completion on average."""
        return torch.full_like(traj, batch.completion_len // 2)

    def behaviour(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> None:
        return None  # outside any recorded state: no behaviour policy, the ratio is against prox

    def versions(self, batch: TrajectoryBatch, traj: Tensor, step: Tensor) -> Tensor:
        """The whole completion is scored: as old as the trajectory's oldest step."""
        return batch.policy_version[traj]


def _oldest(batch: TrajectoryBatch, traj: Tensor, scored: Tensor) -> Tensor:
    """[R] the oldest version among each row's ``scored`` [R, L] positions (a row scoring none: its
    trajectory's ``policy_version``)."""
    v = batch.versions()[traj].masked_fill(~scored, torch.iinfo(torch.long).max).min(1).values
    return torch.where(scored.any(1), v, batch.policy_version[traj])


def row_inputs(batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, view: RowView,
               prompt_mask: Tensor | None = None, comp_mask: Tensor | None = None,
               scored: Tensor | None = None) -> tuple[Tensor, Tensor, int, Tensor]:
    """-> x [R, T], attn [R, T], prompt width, commit [R, L] for the given rows: the completion
    state and commit of ``view``; prompt tokens masked where ``prompt_mask`` [R, P] says
    (right-aligned; any row kind may take one: d1's random prompt masking)."""
    prompt, real = left_pad([batch.prompt_ids[i] for i in traj.tolist()], tok.pad_id)
    state, commit = view.state(batch, batch.completion_ids[traj], traj, step, tok.mask_id, comp_mask, scored)
    if prompt_mask is not None:
        prompt = prompt.masked_fill(prompt_mask[:, -prompt.shape[1]:] & real, tok.mask_id)
    x = torch.cat([prompt, state], dim=1)
    attn = torch.cat([real, torch.ones_like(state, dtype=torch.bool)], dim=1)
    return x, attn, prompt.shape[1], commit


def prompt_masks(batch: TrajectoryBatch, draws: Draws, epochs: int, n: int, prob: float) -> Tensor:
    """[E, n, B, P] random prompt masks (d1: each prompt token masked with ``prob``), right-aligned
    as :func:`row_inputs` aligns prompts: each trajectory draws for its own prompt length, so its
    masks are the same in any batch (P, the widest prompt, depends on the batch)."""
    width = max(len(p) for p in batch.prompt_ids)

    def one(b: int, g: torch.Generator) -> Tensor:
        own = len(batch.prompt_ids[b])
        out = torch.zeros(epochs, n, 1, width, dtype=torch.bool)
        out[..., width - own:] = torch.rand(epochs, n, 1, own, generator=g) < prob
        return out

    return draws.cat(one, dim=2, stream=STREAM_PROMPT)


RECORDED = RecordedStep()


def score_rows(model, batch: TrajectoryBatch, traj: Tensor, step: Tensor, tok: CharTokenizer, temperature: float,
               view: RowView = RECORDED, prompt_mask: Tensor | None = None, comp_mask: Tensor | None = None,
               scored: Tensor | None = None):
    """Current-policy log-probs of the committed tokens of each row: logp, entropy, commit [R, L].

    Logits are computed at the committed positions only (an ADPO row commits a few of L tokens; at
    a 126k vocabulary the whole completion's logits are the update's largest tensor): the n
    positions of the widest row, other rows padded with uncommitted positions that are masked."""
    x, attn, width, commit = row_inputs(batch, traj, step, tok, view, prompt_mask, comp_mask, scored)
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
    """Rows of a masked-diffusion batch for the engine (a :class:`RowScorer`): the state each row
    sees and what it scores come from ``view``, the row kind its estimator picked
    (algo/estimators/: ``adpo``'s recorded steps, ``meanfield``'s and ``wd1``'s fully masked
    completions, ``coupled``'s mask pairs), and the masks drawn for it, one set per epoch."""

    batch: TrajectoryBatch
    tok: CharTokenizer
    temperature: float
    view: RowView = RECORDED
    prompt_masks: Tensor | None = None  # [E, n, B, P]: meanfield's n prompt masks per epoch
    comp_masks: Tensor | None = None    # [E, n, B, L]: coupled's n masks M per epoch (each pair: M, ~M)
    epoch: int = 0

    @property
    def width(self) -> int:
        return self.batch.completion_len

    def row_cost(self, traj: Tensor, step: Tensor, head: float) -> Tensor:
        """[R] memory of each row in positions: its forward's plus ``head`` per scored position."""
        return seq_len(self.batch) + head * self.view.scored_count(self.batch, traj, step).float()

    @property
    def per_epoch(self) -> bool:
        """Rows change between epochs (fresh masks), so the proximal policy is scored per epoch."""
        return self.view.per_epoch

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
        return score_rows(model, self.batch, traj, step, self.tok, self.temperature, self.view, pm, cm)

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor | None:
        return self.view.behaviour(self.batch, traj, step)

    def versions(self, traj: Tensor, step: Tensor) -> Tensor:
        return self.view.versions(self.batch, traj, step)
