"""A global batch read in shares: each learner rank reads, holds and scores only its own share.

Why: an update consumes ``async_rl.global_batch`` completions (B sampler batches of n rows, in
groups of G = ``train.group_size``). With D ranks, rank r owns the r-th of D blocks of the B n
trajectories (:func:`owned_rows`) and reads the sampler batches its block touches
(:func:`my_share`): about B / D + 1 of them. The deal's unit is one trajectory: the sampler
computed the advantages with the whole group, and a row's random draws and minibatch are the
same whichever rank holds it (algo/draws.py, algo/ranks.py::Ranks.rows_before). An estimator that
reads a group in the update (wd1's softmax, ESPO's stratified counts: ``Estimator.whole_groups``)
is dealt whole groups instead, so each of its groups stays on one rank.

The ranks exchange only their verdicts on the batches they read (:func:`agree`: fresh, dropped or
quarantined, a few bytes per batch) so all keep one ledger. Nothing else of another rank's
trajectories is gathered, built or scored: every random draw of the update is keyed by (update,
trajectory) (algo/draws.py), and what the update needs of the whole batch is a handful of sums
(kept trajectories, the collapse guard's health, the stats, a split group's rows below) reduced
over ranks (algo/update.py, algo/guard.py). So a rank's host work and memory per update follow
its share (B n / D rows), not B, and the D ranks together still make one process's update of the
whole batch.

The blocks are equal unless the ranks' speeds are given (``async_rl.deal = "speed"``,
:class:`RankSpeeds`): then rank r owns a block sized by its measured trajectories per second, so a
rank that runs slower (same-model GPUs differ by several percent: Sinha et al., SC22, "Not All
GPUs Are Created Equal") gets fewer rows and the update waits for the mean speed, not the
slowest. The unit bounds how closely: at 10 groups of 6 a rank and GPUs 5% apart, the best deal in
whole groups leaves the slowest rank 5% over the mean, one in single trajectories 0.8%. Which rank
holds a row changes only where the update's sums are added up, so the update is still one
process's to float tolerance.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import torch
from torch import Tensor

from miles_core.algo.draws import trajectory_keys
from miles_core.algo.estimators import get_estimator
from miles_core.learner.ledger import Verdict
from miles_core.parallel import World
from miles_core.types import Batch



def cuts(units: int, size: int, speeds: Sequence[float] | None = None) -> list[int]:
    """[size + 1] the first unit of each rank's block and the end: equal blocks, ceil(r U / D);
    or, with ``speeds`` (one per rank, > 0), blocks that make the slowest rank's time, its units
    over its speed, as small as whole units allow with one unit each (so every rank stays
    measured and a rank slow for a while gets its share back): each unit in turn to the rank
    that would finish it first, optimal for unit jobs on machines of different speeds. Equal
    speeds give the equal blocks."""
    if speeds is not None and (len(speeds) != size or min(speeds) <= 0):
        raise ValueError(f"speeds must be {size} positive numbers, one per rank: {list(speeds)}")
    if speeds is None or units < size or len(set(speeds)) == 1:
        return [-(-r * units // size) for r in range(size + 1)]
    # greedy from one unit each: the next unit to the rank that would finish it first. Its
    # slowest time T is at least U / S, and every rank's first floor(U s_r / S) units finish
    # by then, so the greedy starts there (fewer than D + 1 units left, not U)
    total = float(sum(speeds))
    blocks = [max(1, int(units * s / total)) for s in speeds]
    if sum(blocks) > units:
        blocks = [1] * size
    left = [((b + 1) / s, r) for r, (b, s) in enumerate(zip(blocks, speeds))]
    heapq.heapify(left)
    for _ in range(units - sum(blocks)):
        _, r = heapq.heappop(left)
        blocks[r] += 1
        heapq.heappush(left, ((blocks[r] + 1) / speeds[r], r))
    return [0, *itertools.accumulate(blocks)]


def deal_unit(group: int, estimator: str) -> int:
    """Rows per unit of the deal for ``update.estimator``: a whole group (``train.group_size``)
    for an estimator that reads its trajectories' groups in the update, else one trajectory."""
    return group if get_estimator(estimator).whole_groups else 1


def owned_rows(j: int, n: int, batches: int, unit: int, world: World,
               speeds: Sequence[float] | None = None) -> Tensor:
    """[n] bool: the rows of sampler batch ``j`` this rank owns. Row i of batch j is global row
    j n + i, in unit (j n + i) // ``unit`` (rows per unit: 1, or a whole group's G); rank r owns
    units [c_r, c_{r+1}) of the U = B n / unit (:func:`cuts`; equal blocks: the u with u D // U == r).
    With fewer units than ranks (a run's last, short update) some ranks own none: they take part in
    the update's collectives with no rows (algo/update.py)."""
    own = owned_units(batches, n, unit, world, speeds)
    g = torch.arange(j * n, (j + 1) * n) // unit
    return (g >= own.start) & (g < own.stop)


def owned_units(batches: int, n: int, unit: int, world: World, speeds: Sequence[float] | None = None) -> range:
    """The units of ``unit`` rows this rank owns, [c_r, c_{r+1}) of :func:`cuts` (U = B n / unit)."""
    if n % unit:
        raise ValueError(f"a sampler batch of {n} rows is not whole units of {unit} rows (train.group_size)")
    units, r, d = batches * n // unit, world.rank, world.size
    if speeds is None:  # O(1): host_costs times this at thousands of ranks
        return range(-(-r * units // d), -(-(r + 1) * units // d))
    c = cuts(units, d, speeds)
    return range(c[r], c[r + 1])


def my_share(batches: int, n: int, unit: int, world: World, speeds: Sequence[float] | None = None) -> list[int]:
    """The sampler batches (positions 0..batches-1) this rank reads: those holding a row it owns
    (closed form: the batches its units fall in, O(share) whatever B and D)."""
    own = owned_units(batches, n, unit, world, speeds)
    if not own:
        return []
    return list(range(own.start * unit // n, ((own.stop - 1) * unit) // n + 1))


def first_reader(j: int, n: int, batches: int, unit: int, world: World,
                 speeds: Sequence[float] | None = None) -> bool:
    """Whether this rank is the lowest one reading batch ``j`` (it alone quarantines a corrupt one):
    the owner of the batch's first unit, since ranks own units in order."""
    return j * n // unit in owned_units(batches, n, unit, world, speeds)


def held_rows(bid: str, j: int, batch: Batch, batches: int, unit: int, group: int, world: World,
              speeds: Sequence[float] | None = None) -> tuple[Batch, Tensor, Tensor]:
    """This rank's rows of sampler batch ``j`` (id ``bid``) of ``batches`` (dealt in units of
    ``unit`` rows), their trajectories' keys [R] (algo/draws.py) and the keys of their groups'
    first members [R] (groups of ``group`` consecutive rows; a group can straddle ranks when
    single trajectories are dealt): all of them, uncopied, in a world of one."""
    keys = trajectory_keys(bid, len(batch))
    leads = keys[torch.arange(len(batch)) // group * group]
    if world.size == 1:
        return batch, keys, leads
    mine = owned_rows(j, len(batch), batches, unit, world, speeds).nonzero().squeeze(1)
    return batch.select(mine), keys[mine], leads[mine]


def agree(n: int, mine: dict[int, Verdict], world: World) -> list[Verdict]:
    """Every rank's verdict on the batches it read, gathered: the verdict on each of the ``n``
    batches in order (a batch read by several ranks is judged alike by each: same bytes, same
    version). Only verdicts travel, never rows."""
    if world.size == 1:  # one process read every batch: nothing to exchange
        return [v for _, v in sorted(mine.items())]
    gathered = world.all_gather_object(mine)
    merged: dict[int, Verdict] = {}
    for share in gathered:  # O(B + D): each rank read about B / D + 1 batches
        for j, v in share.items():
            merged.setdefault(j, v)
    return [merged[j] for j in range(n)]


class RankSpeeds:
    """Each rank's update speed, trajectories per second, agreed by every rank: the deal of the
    next global batch under ``async_rl.deal = "speed"``.

    A rank's work is its update's wall time less what it waited in collectives
    (``World.waited_s``): a fast rank that waits for a slow one in the gradient all-reduce has
    not worked that long. One all-reduce of D floats per update shares the figures, so every rank
    deals from the same numbers. Smoothed (``keep`` of the old value each update) so one noisy
    update does not swing the deal; a rank that held no rows keeps its old figure. ``speeds`` is
    None (equal blocks) until every rank has been measured once."""

    def __init__(self, keep: float = 0.5) -> None:
        self.keep = keep
        self.speeds: list[float] | None = None

    def observe(self, world: World, rows: int, busy_s: float) -> list[float] | None:
        """Record this rank's ``rows`` trajectories updated in ``busy_s`` seconds of its own work
        (collective on every rank) -> the speeds the next global batch is dealt by."""
        mine = torch.zeros(world.size, dtype=torch.float64)
        mine[world.rank] = rows / busy_s if rows and busy_s > 0 else 0.0
        seen = world.all_reduce_(mine).tolist()
        old = self.speeds
        if old is None:
            self.speeds = seen if min(seen) > 0 else None
        else:
            self.speeds = [o if s <= 0 else self.keep * o + (1 - self.keep) * s for o, s in zip(old, seen)]
        return self.speeds
