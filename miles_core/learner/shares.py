"""A global batch read in shares: each learner rank reads, holds and scores only its own share.

Why: an update consumes ``async_rl.global_batch`` completions (B sampler batches of n rows, in
groups of G = ``train.group_size``). With D ranks, rank r owns the r-th of D equal blocks of the
B n / G groups (:func:`owned_rows`: whole groups, so a group's advantages and any estimator
that reads a group, wd1's softmax or ESPO's stratified counts, stay on one rank) and reads the
sampler batches its block touches (:func:`my_share`): about B / D + 1 of them. The ranks exchange
only their verdicts on the batches they read (:func:`agree`: fresh, dropped or quarantined, a
few bytes per batch) so all keep one ledger. Nothing else of another rank's trajectories is
gathered, built or scored: every random draw of the update is keyed by (update, trajectory)
(algo/draws.py), and what the update needs of the whole batch is a handful of sums (kept
trajectories, the collapse guard's health, the stats) reduced over ranks (algo/update.py,
algo/guard.py). So a rank's host work and memory per update follow its share (B n / D rows),
not B, and the D ranks together still make one process's update of the whole batch.

The blocks are equal unless the ranks' speeds are given (``async_rl.deal = "speed"``,
:class:`RankSpeeds`): then rank r owns a block sized by its measured trajectories per second, so a
rank that runs slower (same-model GPUs differ by several percent: Sinha et al., SC22, "Not All
GPUs Are Created Equal") gets fewer rows and the update waits for the mean speed, not the
slowest. Which rank holds a row changes only where the update's sums are added up, so the update
is still one process's to float tolerance.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import torch
from torch import Tensor

from miles_core.algo.draws import trajectory_keys
from miles_core.learner.ledger import Verdict
from miles_core.parallel import World
from miles_core.types import Batch



def cuts(units: int, size: int, speeds: Sequence[float] | None = None) -> list[int]:
    """[size + 1] the first group of each rank's block and the end: equal blocks, ceil(r U / D);
    or, with ``speeds`` (one per rank, > 0), blocks that make the slowest rank's time, its groups
    over its speed, as small as whole groups allow with one group each (so every rank stays
    measured and a rank slow for a while gets its share back): each group in turn to the rank
    that would finish it first, optimal for unit jobs on machines of different speeds. Equal
    speeds give the equal blocks."""
    if speeds is not None and (len(speeds) != size or min(speeds) <= 0):
        raise ValueError(f"speeds must be {size} positive numbers, one per rank: {list(speeds)}")
    if speeds is None or units < size or len(set(speeds)) == 1:
        return [-(-r * units // size) for r in range(size + 1)]
    # greedy from one group each: the next group to the rank that would finish it first. Its
    # slowest time T is at least U / S, and every rank's first floor(U s_r / S) groups finish
    # by then, so the greedy starts there (fewer than D + 1 groups left, not U)
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


def owned_rows(j: int, n: int, batches: int, group: int, world: World,
               speeds: Sequence[float] | None = None) -> Tensor:
    """[n] bool: the rows of sampler batch ``j`` this rank owns. Row i of batch j is global row
    j n + i, in group (j n + i) // G; rank r owns groups [c_r, c_{r+1}) of the U = B n / G
    (:func:`cuts`; equal blocks: the g with g D // U == r). With fewer groups than ranks (a run's
    last, short update) some ranks own none: they take part in the update's collectives with no
    rows (algo/update.py)."""
    own = owned_groups(batches, n, group, world, speeds)
    g = torch.arange(j * n, (j + 1) * n) // group
    return (g >= own.start) & (g < own.stop)


def owned_groups(batches: int, n: int, group: int, world: World, speeds: Sequence[float] | None = None) -> range:
    """The groups this rank owns, [c_r, c_{r+1}) of :func:`cuts` (U = B n / G groups)."""
    if n % group:
        raise ValueError(f"a sampler batch of {n} rows is not whole groups of train.group_size={group}")
    units, r, d = batches * n // group, world.rank, world.size
    if speeds is None:  # O(1): host_costs times this at thousands of ranks
        return range(-(-r * units // d), -(-(r + 1) * units // d))
    c = cuts(units, d, speeds)
    return range(c[r], c[r + 1])


def my_share(batches: int, n: int, group: int, world: World, speeds: Sequence[float] | None = None) -> list[int]:
    """The sampler batches (positions 0..batches-1) this rank reads: those holding a row it owns
    (closed form: the batches its groups fall in, O(share) whatever B and D)."""
    own = owned_groups(batches, n, group, world, speeds)
    if not own:
        return []
    return list(range(own.start * group // n, ((own.stop - 1) * group) // n + 1))


def first_reader(j: int, n: int, batches: int, group: int, world: World,
                 speeds: Sequence[float] | None = None) -> bool:
    """Whether this rank is the lowest one reading batch ``j`` (it alone quarantines a corrupt one):
    the owner of the batch's first group, since ranks own groups in order."""
    return j * n // group in owned_groups(batches, n, group, world, speeds)


def held_rows(bid: str, j: int, batch: Batch, batches: int, group: int, world: World,
              speeds: Sequence[float] | None = None) -> tuple[Batch, Tensor]:
    """This rank's rows of sampler batch ``j`` (id ``bid``) of ``batches``, and their trajectories'
    keys [R] (algo/draws.py): all of them, uncopied, in a world of one."""
    keys = trajectory_keys(bid, len(batch))
    if world.size == 1:
        return batch, keys
    mine = owned_rows(j, len(batch), batches, group, world, speeds).nonzero().squeeze(1)
    return batch.select(mine), keys[mine]


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
