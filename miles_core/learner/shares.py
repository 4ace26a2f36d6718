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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_core.algo.draws import trajectory_keys
from miles_core.learner.ledger import Verdict
from miles_core.parallel import World
from miles_core.types import Batch



def owned_rows(j: int, n: int, batches: int, group: int, world: World) -> Tensor:
    """[n] bool: the rows of sampler batch ``j`` this rank owns. Row i of batch j is global row
    j n + i, in group (j n + i) // G; rank r owns groups [r U / D, (r + 1) U / D), U = B n / G.
    With fewer groups than ranks (a run's last, short update) some ranks own none: they take part
    in the update's collectives with no rows (algo/update.py)."""
    if n % group:
        raise ValueError(f"a sampler batch of {n} rows is not whole groups of train.group_size={group}")
    units = batches * n // group
    g = torch.arange(j * n, (j + 1) * n) // group
    return g * world.size // units == world.rank


def owned_groups(batches: int, n: int, group: int, world: World) -> range:
    """The groups this rank owns, [ceil(r U / D), ceil((r + 1) U / D)): the g with g D // U == r,
    as :func:`owned_rows` deals them (U = B n / G groups)."""
    if n % group:
        raise ValueError(f"a sampler batch of {n} rows is not whole groups of train.group_size={group}")
    units = batches * n // group
    return range(-(-world.rank * units // world.size), -(-(world.rank + 1) * units // world.size))


def my_share(batches: int, n: int, group: int, world: World) -> list[int]:
    """The sampler batches (positions 0..batches-1) this rank reads: those holding a row it owns
    (closed form: the batches its groups fall in, O(share) whatever B and D)."""
    own = owned_groups(batches, n, group, world)
    if not own:
        return []
    return list(range(own.start * group // n, ((own.stop - 1) * group) // n + 1))


def first_reader(j: int, n: int, batches: int, group: int, world: World) -> bool:
    """Whether this rank is the lowest one reading batch ``j`` (it alone quarantines a corrupt one):
    the owner of the batch's first group, since ranks own groups in order (O(1))."""
    units = batches * n // group
    return (j * n // group) * world.size // units == world.rank


def held_rows(bid: str, j: int, batch: Batch, batches: int, group: int, world: World) -> tuple[Batch, Tensor]:
    """This rank's rows of sampler batch ``j`` (id ``bid``) of ``batches``, and their trajectories'
    keys [R] (algo/draws.py): all of them, uncopied, in a world of one."""
    keys = trajectory_keys(bid, len(batch))
    if world.size == 1:
        return batch, keys
    mine = owned_rows(j, len(batch), batches, group, world).nonzero().squeeze(1)
    return batch.select(mine), keys[mine]


def agree(n: int, mine: dict[int, Verdict], world: World) -> list[Verdict]:
    """Every rank's verdict on the batches it read, gathered: the verdict on each of the ``n``
    batches in order (a batch read by several ranks is judged alike by each: same bytes, same
    version). Only verdicts travel, never rows."""
    if world.size == 1:  # one process read every batch: nothing to exchange
        return [v for _, v in sorted(mine.items())]
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, mine)
    merged: dict[int, Verdict] = {}
    for share in gathered:  # O(B + D): each rank read about B / D + 1 batches
        for j, v in share.items():
            merged.setdefault(j, v)
    return [merged[j] for j in range(n)]
