"""What data-parallel ranks add to the update (algo/update.py::update_on_rows), in one object the
update of a process alone never builds, so that update reads the same with or without ranks.

With D ranks each holds the rows of its own trajectories (learner/shares.py) and the D updates
together must be one process's update of the whole batch. That needs three things: the gradient
summed over ranks before clipping (one all-reduce; sharded, FSDP's reduce-scatter after the last
backward of a minibatch, parallel.py), FSDP's average made that sum (each rank's loss x D), and,
sharded, every rank running as many forwards and backwards as the busiest one (each is a
collective): padding passes of one row whose loss is multiplied by 0. Dealt single trajectories
(learner/shares.py), a group can straddle ranks; then a rank also learns how many of its first
group's rows the lower ranks hold, so each row's minibatch is the one a process alone would give it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor

from miles_core.algo.draws import Draws
from miles_core.algo.rows import Rows, RowScorer
from miles_core.models.lora import reference_policy
from miles_core.models.window import inner
from miles_core.parallel import World, full_tensors


class Ranks:
    """This rank's side of a data-parallel update. ``pad``: the scorer and rows a sharded rank pads
    with (its own; a rank holding none pads with a row of a batch of its own, update_policy)."""

    def __init__(self, world: World, pad: tuple[RowScorer, Rows], kl_coef: float = 0.0) -> None:
        self.world, self.pad, self.kl_coef = world, pad, kl_coef
        self.sharded = world.sharded
        if self.sharded and pad[1].traj.numel() == 0:
            raise ValueError("a sharded update needs a row to pad with on every rank (update_policy passes one)")

    @property
    def loss_scale(self) -> float:
        """What a rank's loss is multiplied by before backward: D when sharded (FSDP averages)."""
        return float(self.world.size) if self.sharded else 1.0

    def chunks(self, model: Any, cs: list[Tensor], backward: bool) -> Iterator[Tensor]:
        """This rank's chunks ``cs``; sharded, as many passes as the busiest rank runs (the missing
        ones run here as padding) with gradients reduce-scattered after the last backward only."""
        if not self.sharded:
            yield from cs
            return
        n = int(self.world.max_over_ranks(len(cs)))
        for i in range(n):
            if backward:  # accumulate unsharded; reduce-scatter once, after the minibatch's last chunk
                inner(model).set_requires_gradient_sync(i == n - 1)
            if i < len(cs):
                yield cs[i]
            else:
                self.pad_pass(model, backward)

    def pad_pass(self, model: Any, backward: bool) -> None:
        """One row of ``pad`` through the same passes as a real chunk, its loss x 0 (non-finite
        log-probs zeroed first): FSDP's collectives match and nothing is added to gradient or stats."""
        scorer, rows = self.pad
        t, k = rows.traj[:1], rows.step[:1]
        logp = scorer.score(model, t, k)[0]
        if backward and self.kl_coef > 0:
            with torch.no_grad(), reference_policy(model) as ref_model:
                scorer.score(ref_model, t, k)
        if backward:
            (torch.nan_to_num(logp, 0.0, 0.0, 0.0).sum() * 0.0).backward()

    def rows_before(self, traj: Tensor, draws: Draws) -> Tensor | None:
        """[B] for each trajectory here, the rows of its group the lower ranks hold (traj [R]: the
        rows' trajectories), for algo/draws.py::minibatches; None when groups are held whole (no
        ``draws.leads``). Ranks hold trajectories in the global batch's order, so only a rank's
        first group can have members below it, and only a lower rank's last group can be that
        group: each rank sends its last group's first-member key (two 32-bit halves, exact in
        float64) and its rows there, one all-reduce of 4 D numbers."""
        if draws.leads is None:
            return None
        world, b = self.world, len(draws)
        sent = torch.zeros(world.size, 4, dtype=torch.float64)  # [D, (holds any, key high, key low, rows)]
        if b:
            last = int(draws.leads[-1])
            sent[world.rank] = torch.tensor([1.0, float(last >> 32), float(last & 0xFFFFFFFF),
                                             float((draws.leads[traj] == last).sum())], dtype=torch.float64)
        seen = world.all_reduce_(sent)[:world.rank]
        out = torch.zeros(b, dtype=torch.long)
        if b:
            first = int(draws.leads[0])
            same = (seen[:, 0] > 0) & (seen[:, 1] == float(first >> 32)) & (seen[:, 2] == float(first & 0xFFFFFFFF))
            out[draws.leads == first] = int(seen[same, 3].sum())
        return out

    def sum_grads(self, params: list) -> None:
        """Gradients summed over ranks (sharded: FSDP reduce-scattered them in the last backward)."""
        if not self.sharded:
            self.world.sync_grads(params)

    def full(self, t: Tensor) -> Tensor:
        """A sharded tensor (the clipped gradient's norm) gathered whole."""
        return full_tensors(t)
