"""How to split a run's devices between samplers and learner ranks for the recipe's global batch,
from measured seconds per completion.

Why from measurements: a device spends ``rollout_s`` sampling and scoring a completion, or
``update_s`` learning from it (one learner rank). Samplers then make S / rollout_s completions per
second and D ranks take D / update_s; the run goes at the slower side's pace and the faster side
idles. The split that balances them (S : D = rollout_s : update_s) leaves neither idle, and
:func:`place` prints what each side is predicted to idle for any split, so a run never starts on
an unbalanced split silently.

The global batch is the user's (``async_rl.global_batch``, B sampler batches per update): it is
the optimiser's batch, so placement never changes it. It bounds how many samplers can be kept
busy: a sampler may start slot k only while k < (S_max + v + 1) B (learner/channels.py::admits, S_max =
``async_rl.max_staleness``); the window holds the B batches the learner assembles, the B it updates
on and those in flight, and a rollout must land within S_max versions of its start, with
:data:`SLACK_VERSIONS` versions kept for rollout-time variance. So about (S_max - 1 - slack) B
samplers sample at once (:func:`admitted_samplers`); more wait in admission, which is the honest
cost of a global batch small for the fleet (strong scaling), and :func:`place` then gives the
devices to learner ranks, which shorten the versions, instead. :func:`admitting_batch` is the
smallest global batch that keeps S samplers admitted (what weak scaling grows with the fleet).
Learner ranks split the update in units, single trajectories or whole groups for an estimator
that reads them (learner/shares.py), and the busiest rank sets the update's pace, so D ranks over
U units work as U / ceil(U / D) even ones: :func:`place` weighs that (never more ranks than
units), and with ``round_down`` may lower the global batch by at most that fraction (never raise
it) to one whose units divide evenly over the ranks of a better split. With ``rank_cv`` (the spread of one rank's update time, stated: nothing here measures it)
the slowest of D ranks is expected to take 1 + cv E[max of D standard normals] times the mean,
and the split leaves the learner that margin.
"""

from __future__ import annotations

import math
import time
from statistics import NormalDist
from dataclasses import dataclass
from pathlib import Path

from miles_core.config import RecipeConfig


@dataclass(frozen=True)
class Placement:
    samplers: int
    learner_ranks: int
    sampler_idle: float        # predicted fraction of time the samplers wait
    learner_idle: float        # predicted fraction of time the learner ranks wait
    batches_per_update: int    # B: sampler batches per update (async_rl.global_batch / batch completions)
    admitted: int              # samplers the admission window keeps sampling (admitted_samplers)
    pace: float                # predicted completions per second the run goes at (the slower side's)

    def describe(self) -> str:
        out = (f"{self.samplers} samplers : {self.learner_ranks} learner ranks, predicted idle: samplers "
               f"{self.sampler_idle:.1%}, learner {self.learner_idle:.1%}; {self.batches_per_update} sampler "
               "batches per update")
        if self.samplers > self.admitted:
            out += (f"; the global batch admits {self.admitted} samplers at a time (the rest wait in admission: "
                    "raise async_rl.global_batch or async_rl.max_staleness to use them)")
        return out


SLACK_VERSIONS = 3  # for rollout-time variance (module docstring)


def admitted_samplers(batches_per_update: int, max_staleness: int) -> int:
    """Samplers the admission window of a global batch of B sampler batches keeps sampling."""
    return max(1, (max_staleness - 1 - SLACK_VERSIONS) * batches_per_update)


def admitting_batch(samplers: int, max_staleness: int) -> int:
    """The smallest B whose admission window keeps ``samplers`` sampling (module docstring)."""
    return max(1, math.ceil(samplers / max(max_staleness - 1 - SLACK_VERSIONS, 1)))


def even_ranks(learner_ranks: int, units: int | None, rank_cv: float = 0.0) -> float:
    """What D ranks sharing U units (learner/shares.py) are worth in even ranks: U / ceil(U / D)
    (the busiest holds ceil(U / D) units and the others wait for it; D itself when U is not
    given), over the slowest rank's expected factor :func:`straggler`."""
    even = learner_ranks if units is None else units / math.ceil(units / learner_ranks)
    return even / straggler(learner_ranks, rank_cv)


def straggler(ranks: int, rank_cv: float) -> float:
    """The slowest of ``ranks`` update times over their mean, each normal with CV ``rank_cv``:
    1 + cv E[max of D standard normals], E[max] taken as Phi^-1((D - 0.375) / (D + 0.25)) (Blom's
    plotting position of the largest of D)."""
    if ranks <= 1 or rank_cv <= 0:
        return 1.0
    return 1.0 + rank_cv * NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))


def predict(samplers: int, learner_ranks: int, rollout_s: float, update_s: float, max_staleness: int,
            batches_per_update: int = 1, units_per_update: int | None = None, rank_cv: float = 0.0) -> Placement:
    """Idle fractions of a given split, from seconds per completion on one device."""
    if samplers < 1 or learner_ranks < 1 or rollout_s <= 0 or update_s <= 0:
        raise ValueError("placement needs >= 1 sampler, >= 1 learner rank and positive seconds per completion "
                         f"(got {samplers}, {learner_ranks}, {rollout_s}, {update_s})")
    admitted = admitted_samplers(batches_per_update, max_staleness)
    # completions per second each side can do (samplers beyond the window wait in admission)
    make = min(samplers, admitted) / rollout_s
    take = even_ranks(learner_ranks, units_per_update, rank_cv) / update_s
    pace = min(make, take)
    return Placement(samplers, learner_ranks, 1 - pace / (samplers / rollout_s), 1 - pace / take,
                     batches_per_update, admitted, pace)


def even_batch(batches: int, units_per_batch: int, ranks: int, round_down: float) -> int:
    """The largest global batch (in sampler batches) in [batches x (1 - round_down), batches] whose
    units divide evenly over ``ranks``; ``batches`` itself when there is none."""
    step = ranks // math.gcd(ranks, units_per_batch)       # B' x g divisible by D <=> B' divisible by step
    even = batches // step * step
    return even if even >= max(1, batches * (1 - round_down)) else batches


def place(devices: int, rollout_s: float, update_s: float, max_staleness: int, batches_per_update: int = 1,
          units_per_batch: int | None = None, round_down: float = 0.0, rank_cv: float = 0.0) -> Placement:
    """The split of ``devices`` (>= 2) with the highest throughput for the global batch of
    ``batches_per_update`` sampler batches of ``units_per_batch`` units (when given: at most as
    many ranks as units, the busiest one's share setting the pace; with ``round_down`` the batch
    may be lowered by that fraction so the ranks hold equal shares). Ties go to the larger batch,
    then to fewer learner ranks."""
    if devices < 2:
        raise ValueError(f"placement needs at least 2 devices (one sampler, one learner rank), got {devices}")
    splits = []
    for d in range(1, devices):
        b = batches_per_update if units_per_batch is None else even_batch(batches_per_update, units_per_batch, d,
                                                                           round_down)
        units = None if units_per_batch is None else b * units_per_batch
        if units is None or d <= units:
            splits.append(predict(devices - d, d, rollout_s, update_s, max_staleness, b, units, rank_cv))
    return max(splits, key=lambda p: (p.pace, p.batches_per_update, -p.learner_ranks))


@dataclass(frozen=True)
class Costs:
    """Measured seconds per completion on this device: sampling + scoring, and one learner rank's update."""

    rollout_s: float
    update_s: float


def measure(cfg: RecipeConfig, base_dir: str | Path, reps: int = 2) -> Costs:
    """Time ``reps`` batches of the run's own code paths with the base model: ``sample_batch``
    (through ``Learner.sample``, with ``async_rl.sampler_threads`` torch threads, as a sampler runs)
    and ``Learner.update`` (with ``learner_threads``). The first batch of each is a warm-up and not
    counted. A batch whose rewards all tie carries no advantage and its update skips rows; those
    are given one winner per group for timing only, so the update costs what a learning batch does."""
    import torch

    from miles_core.algo.rl import assign_advantages
    from miles_core.data.registry import build_task
    from miles_core.learner.policy import Learner

    threads = torch.get_num_threads()
    learner, data = Learner(cfg, base_dir), build_task(cfg)
    completions = cfg.train.prompts_per_iter * cfg.train.group_size
    try:
        torch.set_num_threads(cfg.async_rl.sampler_threads)
        batches, t_roll = [], 0.0
        for seq in range(reps + 1):
            t0 = time.perf_counter()
            batches.append(learner.sample(data, seq, worker="placement"))
            t_roll += (time.perf_counter() - t0) if seq else 0.0
        torch.set_num_threads(cfg.async_rl.learner_threads)
        t_upd = 0.0
        for i, b in enumerate(batches):
            if float(b.reward.std()) == 0.0:
                b.reward = (torch.arange(len(b)) % cfg.train.group_size == 0).float()
                assign_advantages(b)
            t0 = time.perf_counter()
            learner.update(b)
            t_upd += (time.perf_counter() - t0) if i else 0.0
    finally:
        torch.set_num_threads(threads)
    return Costs(t_roll / reps / completions, t_upd / reps / completions)
