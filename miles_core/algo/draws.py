"""Random draws of one update keyed by (update, trajectory), never by a trajectory's position.

Why: with D learner ranks each rank holds only its own trajectories of the global batch
(learner/shares.py). If the rows, their masks and the minibatch each row lands in were drawn
from one generator walking the whole batch in order, a rank would have to walk (and so hold or
rebuild) every trajectory before its own to make the same draws as one process. Keyed draws
make each trajectory's randomness a function of (the update's seed, its key, a stream) alone:
a rank draws for its trajectories only, in any order, and the update equals one process's on
the whole batch. The idea is counter-based RNG (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011); here a SplitMix64 mix of the three numbers seeds a torch generator.

A key is any int64 that names a trajectory for the life of a run: the learner runtime hashes
(batch id, row) (:func:`trajectory_keys`); a caller with one batch and no ids uses its rows'
positions (:meth:`Draws.positional`).
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
STREAM_ROWS = 0        # which rows a trajectory contributes (and their completion masks)
STREAM_PROMPT = 1      # its prompt masks (d1's random prompt masking)
STREAM_GROUP = 2       # what its group shares, drawn by the group's first member (ESPO's stratified counts)
STREAM_MINIBATCH = 3   # + epoch: which minibatch each of its rows lands in


def splitmix64(x: int) -> int:
    """The SplitMix64 finaliser (Steele, Lea & Flood, OOPSLA 2014): a bijection on 64-bit ints
    whose outputs for consecutive inputs are statistically independent."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def trajectory_keys(batch_id: str, rows: int) -> Tensor:
    """[rows] int64: the keys of a stored batch's trajectories, from its id and each row's index."""
    base = int.from_bytes(hashlib.blake2b(batch_id.encode(), digest_size=8).digest(), "little")
    return torch.tensor([splitmix64(base ^ i) >> 1 for i in range(rows)], dtype=torch.long)


class Draws:
    """One update's random source: ``gen(b, stream)`` is trajectory b's own generator for ``stream``.

    ``seed``: the update's seed (the learner draws it once per update from its generator, so a
    resume repeats it); ``keys`` [B] int64: one per trajectory of the batch these draws serve;
    ``groups`` [B] (optional): each trajectory's group id, which :func:`minibatches` deals by;
    ``leads`` [B] (optional): the key of each trajectory's group's first member, for a batch that
    may hold part of a group only (learner ranks dealt single trajectories, learner/shares.py);
    without them a group's first member here is its first."""

    def __init__(self, seed: int, keys: Tensor, groups: Tensor | None = None, leads: Tensor | None = None) -> None:
        for name, t in (("groups", groups), ("leads", leads)):
            if keys.dim() != 1 or (t is not None and t.shape != keys.shape):
                raise ValueError(f"Draws: keys and {name} must be one int per trajectory, got shapes "
                                 f"{tuple(keys.shape)} and {None if t is None else tuple(t.shape)}")
        self.seed, self.keys, self.groups = int(seed) & MASK64, keys.long(), groups
        self.leads = None if leads is None else leads.long()

    @classmethod
    def seeded(cls, generator: torch.Generator, keys: Tensor, leads: Tensor | None = None) -> Draws:
        """Draws for trajectories ``keys`` (their groups' first members ``leads``), the update's
        seed drawn from ``generator`` (one draw per update, so a seeded generator repeats the update)."""
        return cls(int(torch.randint(1 << 62, (1,), generator=generator)), keys, leads=leads)

    @classmethod
    def positional(cls, generator: torch.Generator, n: int) -> Draws:
        """Draws for one whole batch of ``n`` trajectories keyed by position (:meth:`seeded`)."""
        return cls.seeded(generator, torch.arange(n))

    def __len__(self) -> int:
        return self.keys.numel()

    def select(self, idx: Tensor) -> Draws:
        """The draws of trajectories ``idx`` (a sub-batch keeps each trajectory's own draws)."""
        return Draws(self.seed, self.keys[idx], None if self.groups is None else self.groups[idx],
                     None if self.leads is None else self.leads[idx])

    def with_groups(self, groups: Tensor) -> Draws:
        return Draws(self.seed, self.keys, groups, self.leads)

    def gen(self, b: int, stream: int = STREAM_ROWS) -> torch.Generator:
        """Trajectory b's generator for ``stream``: a function of (seed, key, stream) only."""
        return self.gen_key(int(self.keys[b]), stream)

    def gen_key(self, key: int, stream: int) -> torch.Generator:
        """The generator of the trajectory named ``key`` (held here or not) for ``stream``."""
        x = splitmix64(self.seed ^ splitmix64(key & MASK64) ^ splitmix64(stream + 0x5EED))
        return torch.Generator().manual_seed(x >> 1)

    def cat(self, fn: Callable[[int, torch.Generator], Tensor], dim: int, stream: int = STREAM_ROWS) -> Tensor:
        """``fn(b, generator)``'s draw for each trajectory b from its own generator, concatenated
        along ``dim`` (``fn`` returns the slice of one trajectory: size 1 along ``dim``). A draw
        whose size would depend on the batch (the widest prompt, the most steps) is made at the
        trajectory's own size and padded, so it is the same in any batch."""
        return torch.cat([fn(b, self.gen(b, stream)) for b in range(len(self))], dim)


def minibatches(traj: Tensor, draws: Draws, count: int, epoch: int, before: Tensor | None = None) -> list[Tensor]:
    """The rows (indices into ``traj`` [R]) of each of ``count`` minibatches in ``epoch``.

    Each group (``draws.groups``; without them each trajectory alone) deals its rows, member
    after member (each member's rows in the order given), round-robin over the minibatches from an
    offset its first member draws (stream ``STREAM_MINIBATCH + epoch``): a group of G one-row
    trajectories puts G / count in each, a trajectory's many rows spread evenly over the
    optimizer steps, and the minibatch sizes are equal up to each group's remainder, as a global
    shuffle's are, without any rank seeing the others' rows. A row's minibatch depends on its
    group alone: on a rank holding part of a group (learner/shares.py deals single trajectories)
    the offset comes from the first member's key (``draws.leads``) and ``before`` [B] says how many
    of the group's rows lower ranks hold (algo/ranks.py::Ranks.rows_before), so the rows land
    where one process holding the whole group would put them. Within a minibatch rows keep their
    order in ``traj``."""
    b = len(draws)
    if draws.groups is None:
        leader = torch.arange(b)
    else:  # each trajectory's group's first member (its index in the batch)
        _, inv = torch.unique(draws.groups, return_inverse=True)
        first = torch.full((int(inv.max()) + 1 if b else 0,), b, dtype=torch.long).scatter_reduce(
            0, inv, torch.arange(b), "amin")
        leader = first[inv]                                                          # [B]
    lead = leader[traj]                                                              # [R]
    r = traj.numel()
    order = ((lead * (b + 1) + traj) * (r + 1) + torch.arange(r)).argsort()         # by group, member, as given
    counts = torch.bincount(lead, minlength=b)                                       # [B] rows per group (at its leader)
    within = torch.empty_like(traj)                                                  # [R] row's index in its group
    within[order] = torch.arange(r) - (counts.cumsum(0) - counts)[lead[order]]
    if before is not None:                                                           # rows of its group on lower ranks
        within += before.long()[lead]
    offset = torch.zeros(b, dtype=torch.long)
    for g in leader.unique().tolist():
        key = int(draws.keys[g] if draws.leads is None else draws.leads[g])
        offset[g] = int(torch.randint(count, (1,), generator=draws.gen_key(key, STREAM_MINIBATCH + epoch)))
    slot = (offset[lead] + within) % count
    return [(slot == m).nonzero().squeeze(1) for m in range(count)]
