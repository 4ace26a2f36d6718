"""Which recorded steps of a masked-diffusion batch become ADPO's training rows (the update scores
each row at its recorded state, algo/rows.py): runs of consecutive steps covering all of them (the
default), a uniform random fraction of the steps or of TraceRL's merged runs of s steps, or steps
drawn where the behaviour policy had a choice. Each design's weights make the loss's expectation
the full per-step objective; the tests check each against brute force (tests/test_core_math.py,
tests/test_uncertainty_rows.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from miles_core.algo.draws import Draws
from miles_core.algo.rows import Rows
from miles_core.types import TrajectoryBatch


def step_groups(k_b: int, groups: int, generator: torch.Generator) -> Tensor:
    """[groups + 1] boundaries splitting steps 0 .. k_b - 1 into ``groups`` consecutive runs whose
    lengths differ by at most one, the longer runs at random places (drawn from ``generator``)."""
    q, r = divmod(k_b, groups)
    longer = torch.zeros(groups, dtype=torch.long)
    if r:  # equal runs draw nothing, so rho = 1 keeps the random stream of scoring every step
        longer[torch.randperm(groups, generator=generator)[:r]] = 1
    return torch.cat([torch.zeros(1, dtype=torch.long), (q + longer).cumsum(0)])


def build_rows(batch: TrajectoryBatch, step_fraction: float, draws: Draws, merge: int = 1,
               cover: bool = False) -> Rows:
    """The recorded-step rows of ``batch``: ceil(rho K_b) rows per trajectory (rho = ``step_fraction``).

    ``cover`` (ADPO's default): the rows partition all K_b steps into ceil(rho K_b) runs of
    consecutive steps (lengths floor/ceil of K_b / m_b), so every committed token is scored in every
    update at the cost of rho K_b forwards; a run of one step is scored exactly at its own state.
    Otherwise a random fraction rho of each trajectory's steps (or of its runs of ``merge`` = s > 1
    steps, TraceRL) is scored and reweighted by K_b / m_b, unbiased for the full objective but
    leaving 1 - rho of the tokens without a gradient in that update. Each trajectory draws from
    its own generator (``draws``), so its rows do not depend on the rest of the batch."""
    trajs, steps, weights, bounds = [], [], [], []
    for b, k in enumerate(batch.num_steps.tolist()):
        generator = draws.gen(b)
        if cover and merge == 1:
            m_b = max(1, min(k, math.ceil(step_fraction * k)))
            bounds.append(step_groups(k, m_b, generator))
            trajs.append(torch.full((m_b,), b))
            steps.append(torch.arange(m_b))
            weights.append(torch.ones(m_b))
            continue
        k_b = -(-k // merge)
        m_b = k_b if step_fraction >= 1.0 else max(1, math.ceil(step_fraction * k_b))
        chosen = torch.randperm(k_b, generator=generator)[:m_b] if m_b < k_b else torch.arange(k_b)
        bounds.append(torch.arange(k_b + 1) * merge)
        trajs.append(torch.full((m_b,), b))
        steps.append(chosen.sort().values)
        weights.append(torch.full((m_b,), k_b / m_b))
    width = max(len(x) for x in bounds)
    table = torch.stack([torch.cat([x, x[-1:].expand(width - len(x))]) for x in bounds])  # [B, G + 1]
    singles = merge == 1 and all(len(x) == k + 1 for x, k in zip(bounds, batch.num_steps.tolist()))
    return Rows(torch.cat(trajs), torch.cat(steps), torch.cat(weights), None if singles else table)


def step_uncertainty(batch: TrajectoryBatch) -> Tensor:
    """[B, K] how much choice the behaviour policy had at each recorded step: the sum over the
    tokens committed at step k of 1 - mu(token) (0 for k >= K_b).

    Why this measure: a row's gradient is sum_i A w_i grad log pi(x_i), and the gradient of
    log softmax(z)[x] in the logits is onehot(x) - p, whose norm lies between 1 - p(x) and
    sqrt(2) (1 - p(x)); a step whose committed tokens were near-certain carries almost nothing."""
    k_max = int(batch.num_steps.max())
    sm = batch.step_map
    col = torch.where(sm >= 0, sm, torch.full_like(sm, k_max))                 # -1 (never decided) -> spare
    doubt = (1.0 - batch.logp.double().exp()).clamp_min(0.0) * (sm >= 0)        # [B, L]
    return torch.zeros(sm.shape[0], k_max + 1, dtype=torch.float64).scatter_add_(1, col, doubt)[:, :k_max]


def inclusion_probs(u: Tensor, valid: Tensor, budget: Tensor, floor: float) -> Tensor:
    """[B, K] pi_bk = clamp(c_b u_bk, floor, 1) on valid steps (0 elsewhere), c_b chosen so that
    sum_k pi_bk = budget_b [B] where that is reachable (all at ``floor`` when the floor already
    spends more; every step with u > 0 at 1 when even that spends less). Proportional to u is the
    Horvitz-Thompson design that minimises variance when a step's gradient scales with u; the
    floor keeps every step drawable, which is what makes the reweighted estimate unbiased."""
    u = u.double() * valid
    pos = u > 0
    smallest = torch.where(pos, u, torch.full_like(u, float("inf"))).min(1).values       # [B]
    hi = torch.where(torch.isfinite(smallest), 1.0 / smallest, torch.ones_like(smallest))
    lo = torch.zeros_like(hi)

    def at(c: Tensor) -> Tensor:
        return (c[:, None] * u).clamp(floor, 1.0) * valid

    for _ in range(60):  # bisection on c_b: sum_k pi_bk is non-decreasing in c_b
        mid = (lo + hi) / 2
        under = at(mid).sum(1) < budget
        lo, hi = torch.where(under, mid, lo), torch.where(under, hi, mid)
    return at(hi)


def uncertainty_rows(batch: TrajectoryBatch, step_fraction: float, floor: float, draws: Draws) -> Rows:
    """Recorded-step rows drawn where the behaviour policy had a choice (NSD's allocation applied to
    the update): step k of trajectory b is a row with probability pi_bk (:func:`inclusion_probs` of
    :func:`step_uncertainty`, rho K_b rows expected), independently, with weight 1 / pi_bk, so the
    loss's expectation over the draws is the full objective over every step (Horvitz-Thompson), as
    ``build_rows``' uniform draw is, but the forwards go to the steps whose gradients are not ~0."""
    k_b = batch.num_steps
    valid = torch.arange(int(k_b.max()))[None, :] < k_b[:, None]                # [B, K]
    pi = inclusion_probs(step_uncertainty(batch), valid, step_fraction * k_b.double(), floor)
    width = pi.shape[1]
    u = draws.cat(lambda b, g: F.pad(torch.rand(1, int(k_b[b]), generator=g, dtype=torch.float64),
                                     (0, width - int(k_b[b])), value=2.0), dim=0)  # [B, K]
    take = (u < pi) & valid
    traj, step = take.nonzero(as_tuple=True)
    return Rows(traj, step, (1.0 / pi[traj, step]).float())
