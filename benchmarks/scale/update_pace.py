"""How long one update takes on D learner ranks, for the scale model (benchmarks/scale/sim.py):
the ranks' shares of a global batch in units of the deal (single trajectories, or whole groups for
an estimator that reads them: learner/shares.py in closed form, and its
``cuts`` when GPUs differ in speed), the busiest rank's time, the slowest rank at every optimizer
step, and the ring all-reduce of the gradient."""

from __future__ import annotations

import random
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.sim import Params


def allreduce_s(p: Params) -> float:
    """Ring all-reduce: 2 (D-1) steps, each moving bytes / D (NCCL's bus-bandwidth model)."""
    d = p.learner_ranks
    if d <= 1 or p.allreduce_bytes <= 0:
        return 0.0
    return 2 * (d - 1) * (p.link_latency_s + p.allreduce_bytes / d / p.link_bytes_s)


def shares(batches: int, n: int, d: int, group: int = 1) -> list[int]:
    """How many sampler batches each of ``d`` ranks reads for a global batch of ``batches`` x ``n``
    rows in groups of ``group`` (learner/shares.py::my_share in closed form): with U = B n / G
    groups, rank r owns groups [ceil(r U / D), ceil((r + 1) U / D)) and reads every batch their
    rows touch."""
    units, out = batches * n // group, []
    for r in range(d):
        lo, hi = -(-r * units // d) * group, -(-(r + 1) * units // d) * group
        out.append((hi - 1) // n - lo // n + 1 if hi > lo else 0)
    return out


def largest_share(batches: int, n: int, d: int, group: int = 1) -> int:
    """Rows of the busiest rank's share (whole units of ``group`` rows): it sets the update's pace."""
    units = batches * n // group
    return -(-units // d) * group


def draw_slowness(ranks: int, spread: float, rng: random.Random) -> list[float]:
    """[D] persistent time factors: normal draws of CV ``spread`` floored at half the mean (all
    1 without a spread, drawing nothing). The model's ranks and emulate.py's stand-in ranks both
    draw them here."""
    return [max(1.0 + spread * rng.gauss(0.0, 1.0), 0.5) if spread > 0 else 1.0 for _ in range(ranks)]


def rank_slowness(p: Params, rng: random.Random) -> list[float]:
    """[D] each rank's persistent time factor: ``rank_slowness`` when given, else
    :func:`draw_slowness` of CV ``rank_spread``."""
    if p.rank_slowness:
        return list(p.rank_slowness)
    return draw_slowness(p.learner_ranks, p.rank_spread, rng)


def paced_rows(p: Params, batches: int, slowness: list[float] | None = None) -> float:
    """Rows the update's pace is set by: the busiest rank's share times its slowness (whole units,
    dealt as learner/shares.py::cuts deals them: equal blocks, or by speed, 1 / slowness, as the
    learner measures it)."""
    from miles_core.learner.shares import cuts

    n, d, g = p.completions_per_batch, p.learner_ranks, p.deal_unit
    if d <= 1:
        return batches * n * (slowness[0] if slowness else 1.0)
    if not slowness or all(x == 1.0 for x in slowness):
        return largest_share(batches, n, d, g)
    c = cuts(batches * n // g, d, [1.0 / x for x in slowness] if p.deal == "speed" else None)
    return max((c[r + 1] - c[r]) * g * slowness[r] for r in range(d))


def update_time(p: Params, batches: int = 1, rng: random.Random | None = None,
                slowness: list[float] | None = None) -> float:
    """One update of ``batches`` batches split over the ranks in units of the deal (the busiest rank's
    share, times its persistent ``slowness``, sets the pace: :func:`paced_rows`), plus
    ``minibatches`` gradient all-reduces. With ``rng`` and ``rank_cv``, each rank's time varies
    (normal, that CV) and the slowest of the D sets the pace: the max of D normals is drawn as
    Phi^-1(u^(1/D))."""
    n = p.completions_per_batch
    rows = paced_rows(p, batches, slowness)
    compute, step = 0.0, rows * p.update_s / n / p.minibatches
    for _ in range(p.minibatches):  # each optimizer step waits for the slowest rank, then all-reduces
        slowest = 1.0
        if rng is not None and p.rank_cv > 0 and p.learner_ranks > 1:
            u = max(rng.random(), 1e-12) ** (1.0 / p.learner_ranks)
            slowest = max(1.0 + p.rank_cv * NormalDist().inv_cdf(min(u, 1 - 1e-12)), 0.0)
        compute += step * slowest
    return max(compute, p.min_update_s) + p.minibatches * allreduce_s(p)
