"""Denoising pretraining (SFT) and ADPO on recorded continuous trajectories.

ADPO here is the discrete objective with one change: the per-token log-prob becomes the per-step
Gaussian transition log-prob from :func:`~miles_core.continuous.sde.ddim_step`. Every recorded
step (trajectory b, step k) is an independent row: state x_k, timestep, the recorded next state
x_{k+1} and its behaviour log-prob. Rows are scored on their own, in chunks of ``row_chunk``,
and fed to the shared update engine (algo/update.py, L = 1 "token" per row), so the
clipped ratio vs the proximal policy, the truncated importance weight vs the behaviour policy,
step subsampling and the optional KL to the adapter-off reference all carry over unchanged, and
peak memory does not depend on the number of denoising steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_core.algo.advantages import group_advantages
from miles_core.algo.rows import FixedRows, Rows
from miles_core.algo.ranks import Ranks
from miles_core.algo.update import UpdateRows, as_draws, update_on_rows
from miles_core.config import AdpoSettings, UpdateConfig
from miles_core.continuous.sde import DEFAULT_SCHEDULE, ContinuousBatch, NoiseSchedule, ddim_step, sample_ode, sample_sde
from miles_core.continuous.task import ConstraintTask
from miles_core.models.lora import trainable_parameters
from miles_core.parallel import World


def train_denoiser(model, prompt_ids: Tensor, x0: Tensor, steps: int, batch_size: int, lr: float, seed: int,
                   schedule: NoiseSchedule = DEFAULT_SCHEDULE, weight_decay: float = 0.0) -> list[float]:
    """SFT for a diffusion policy: eps-prediction MSE on demos (prompt_ids [N, P], x0 [N, D]).

    t is uniform over the schedule, so every timestep the samplers visit is trained. Returns the
    loss per step. A cosine learning-rate decay keeps the last steps from bouncing around.
    """
    if prompt_ids.shape[0] != x0.shape[0]:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows but x0 has {x0.shape[0]}")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x0.shape[0], (batch_size,), generator=g)
        t = torch.randint(0, schedule.num_timesteps, (batch_size,), generator=g)
        noise = torch.randn(batch_size, x0.shape[1], generator=g)
        loss = ((model(schedule.add_noise(x0[idx], t, noise), t, prompt_ids[idx]) - noise) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def rollout(model, task: ConstraintTask, prompts: list[str], prompt_ids: Tensor, group_size: int, steps: int,
            eta: float, generator: torch.Generator, policy_version: int = 0, std_normalize: bool = True,
            schedule: NoiseSchedule = DEFAULT_SCHEDULE) -> ContinuousBatch:
    """G recorded SDE samples per prompt, scored by the verifier, with group-relative advantages."""
    model.eval()
    rep = [p for p in prompts for _ in range(group_size)]
    gid = torch.arange(len(prompts)).repeat_interleave(group_size)
    batch = sample_sde(model, rep, prompt_ids.repeat_interleave(group_size, 0), steps, eta, generator,
                       schedule=schedule, group_id=gid, policy_version=policy_version)
    batch.reward = task.reward(rep, batch.samples)
    batch.advantage = group_advantages(batch.reward, batch.group_id, std_normalize=std_normalize)
    return batch


def build_step_rows(n_traj: int, steps: int, fraction: float, generator: torch.Generator,
                    eligible: Tensor | None = None) -> Rows:
    """Every eligible step of every trajectory, or ceil(fraction * n) random ones each, reweighted
    by n/m so the subsampled objective stays unbiased for the sum over eligible steps.

    ``eligible`` [K] bool (default: all) restricts training to some steps, e.g. the low-noise end
    of the chain where the injected noise still reaches the output (see ``update_policy``).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"step fraction must be in (0, 1], got {fraction}")
    pool = torch.arange(steps) if eligible is None else eligible.nonzero().squeeze(1)
    n = pool.numel()
    if n == 0:
        raise ValueError("no eligible steps to train on")
    m = n if fraction >= 1 else max(1, math.ceil(fraction * n))
    if m == n:
        step = pool.repeat(n_traj)
    else:
        step = torch.stack([pool[torch.randperm(n, generator=generator)[:m].sort().values] for _ in range(n_traj)]).flatten()
    return Rows(torch.arange(n_traj).repeat_interleave(m), step, torch.full((n_traj * m,), n / m))


def score_steps(model, batch: ContinuousBatch, traj: Tensor, step: Tensor,
                schedule: NoiseSchedule = DEFAULT_SCHEDULE) -> Tensor:
    """Current-policy log-prob [R] of the recorded transitions (traj[r], step[r]) with ``ddim_step``."""
    x_t, x_prev = batch.latents[traj, step], batch.latents[traj, step + 1]
    return ddim_step(model, x_t, batch.timesteps[step], batch.timesteps[step + 1], batch.prompt_ids[traj],
                     batch.eta, prev_sample=x_prev, schedule=schedule)[1]


@dataclass
class GaussianStepRows(FixedRows):
    """Rows of a continuous batch for the update engine: one scored "token" per (b, k), the
    recorded transition x_k -> x_{k+1} under the Gaussian step of :func:`ddim_step`."""

    batch: ContinuousBatch
    schedule: NoiseSchedule
    width: int = 1

    def score(self, model, traj: Tensor, step: Tensor) -> tuple[Tensor, None, Tensor]:
        logp = score_steps(model, self.batch, traj, step, self.schedule)[:, None]
        return logp, None, torch.ones_like(logp, dtype=torch.bool)

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor:
        return self.batch.logp[traj, step][:, None]


def update_policy(model, optimizer: torch.optim.Optimizer, batch: ContinuousBatch, cfg: UpdateConfig,
                  generator: torch.Generator, schedule: NoiseSchedule = DEFAULT_SCHEDULE,
                  max_timestep: int | None = None, scheduler=None, world: World | None = None,
                  own: AdpoSettings | None = None) -> dict[str, float]:
    """One policy update (``num_minibatches`` x ``epochs`` optimizer steps) on recorded trajectories,
    through the same engine as the discrete learner (:func:`~miles_core.algo.update.update_on_rows`).

    The loss is normalised per (trajectory, step), so chunking only changes peak memory, never the
    gradient; ``update.loss_norm`` picks the trajectories counted (with A != 0, or the whole batch).
    ``max_timestep`` trains only steps that start at t <= it: noise injected at high-noise steps
    is washed out by the later ones, so their policy-gradient rows are almost pure noise and,
    under Adam, make the adapter drift without improving reward. Its rows are ADPO's recorded
    steps, a ``own.step_fraction`` of them (``own``: ADPO's settings; None: their defaults).
    """
    assert batch.advantage is not None
    adv_all = torch.nan_to_num(batch.advantage, nan=0.0)
    keep = (adv_all != 0).nonzero().squeeze(1) if cfg.skip_zero_variance else torch.arange(len(batch))
    stats: dict[str, float] = {"trajectories": float(keep.numel()), "skipped_trajectories": float(len(batch) - keep.numel())}
    if keep.numel() == 0:
        return stats
    eligible = None if max_timestep is None else batch.timesteps[:-1] <= max_timestep
    rows = build_step_rows(keep.numel(), batch.num_steps, (own or AdpoSettings()).step_fraction, generator, eligible)
    rows.traj = keep[rows.traj]
    per_traj = float(rows.weight.sum()) / keep.numel()  # eligible steps per trajectory, whatever the subsampling
    normaliser = per_traj * (keep.numel() if cfg.loss_norm == "informative" else len(batch))
    scorer = GaussianStepRows(batch, schedule)
    u = UpdateRows(scorer, rows, adv_all, normaliser, as_draws(generator, len(batch)))
    stats.update(update_on_rows(model, optimizer, u, cfg, scheduler,
                                None if world is None else Ranks(world, (scorer, rows), cfg.kl_coef)))
    return stats


@torch.no_grad()
def evaluate(model, task: ConstraintTask, prompts: list[str], prompt_ids: Tensor, samples_per_prompt: int,
             steps: int, eta: float, seed: int, schedule: NoiseSchedule = DEFAULT_SCHEDULE,
             batch_size: int = 4096, order: int = 1) -> dict[str, float]:
    """Success rate and mean reward over ``samples_per_prompt`` draws for each prompt.

    eta = 0 runs the deterministic ODE sampler, eta > 0 the SDE sampler; both start from the same
    seeded initial noise, so the two are compared on identical starting points. ``order`` picks
    the ODE solver (1 = DDIM, 2 = DPM-Solver++ 2M; see :func:`sample_ode`).
    """
    model.eval()
    g = torch.Generator().manual_seed(seed)
    rep = [p for p in prompts for _ in range(samples_per_prompt)]
    ids = prompt_ids.repeat_interleave(samples_per_prompt, 0)
    x_init = torch.randn(len(rep), model.config.latent_dim, generator=g)
    outs = []
    for s in range(0, len(rep), batch_size):
        sl = slice(s, s + batch_size)
        if eta == 0:
            outs.append(sample_ode(model, ids[sl], steps, x_init=x_init[sl], schedule=schedule, order=order))
        else:
            step_g = torch.Generator().manual_seed(seed + 1 + s)
            b = sample_sde(model, rep[sl], ids[sl], steps, eta, step_g, schedule=schedule, x_init=x_init[sl])
            outs.append(b.samples)
    v = torch.cat(outs)
    return {"success": float(task.success(rep, v).float().mean()), "mean_reward": float(task.reward(rep, v).mean()),
            "samples": float(len(rep))}
