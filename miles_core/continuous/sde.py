"""DDPM/DDIM noise schedule, THE step function, and the samplers for continuous diffusion.

``ddim_step`` is the continuous counterpart of :func:`miles_core.samplers.step.denoise_step`: one
function both samples a transition x_t -> x_{t_prev} and scores a recorded one, so a behaviour
log-prob written by the sampler and the learner's log-prob of the same step come from the same
arithmetic (ddpo-pytorch's ``ddim_step_with_logprob``; ARCHITECTURE.md, "Continuous policies").

With eta > 0 a step is a Gaussian transition N(mean, std^2 I) (eta = 1 is DDPM's posterior
variance); its log-prob, summed over the latent dims, is the per-step "token" log-prob that the
ADPO loss consumes. With eta = 0 the step is the deterministic DDIM (probability-flow ODE) update
used for fast evaluation; it has no density, so its log-prob is reported as 0.

A trajectory of K steps walks the grid ``schedule.grid(K)`` (K + 1 timesteps, T-1 down to 0) and
records every state: latents [K + 1, D] and log-probs [K]. Latents are small, so O(K * D) per
trajectory is cheap and any step can be rescored on its own, with no backprop through the chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class NoiseSchedule:
    """Discrete DDPM schedule with ``num_timesteps`` steps and linear betas.

    ``alphas_cumprod[t]`` = prod_{s<=t} (1 - beta_s); x_t = sqrt(ab_t) x_0 + sqrt(1 - ab_t) eps.
    The last state of every sampling grid is t = 0 (ab_0 = 1 - beta_start), so every eta > 0 step,
    the final one included, has a strictly positive variance and a finite log-prob.
    """

    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    spacing: str = "karras"     # sampling grid: "karras" (rho=7 in sigma, dense at low noise) or "uniform"
    rho: float = 7.0
    alphas_cumprod: Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_timesteps < 2:
            raise ValueError(f"NoiseSchedule.num_timesteps must be >= 2, got {self.num_timesteps}")
        if not 0 < self.beta_start <= self.beta_end < 1:
            raise ValueError(f"NoiseSchedule: need 0 < beta_start <= beta_end < 1, got {self.beta_start}, {self.beta_end}")
        if self.spacing not in ("karras", "uniform"):
            raise ValueError(f"NoiseSchedule.spacing: {self.spacing!r} is not allowed; allowed: 'karras', 'uniform'")
        betas = torch.linspace(self.beta_start, self.beta_end, self.num_timesteps, dtype=torch.float64)
        object.__setattr__(self, "alphas_cumprod", torch.cumprod(1.0 - betas, 0).float())

    def alpha_bar(self, t: Tensor | int) -> Tensor:
        t = torch.as_tensor(t, dtype=torch.long)
        if bool((t < 0).any()) or bool((t >= self.num_timesteps).any()):
            raise ValueError(f"timestep out of range [0, {self.num_timesteps - 1}]: {t.tolist()}")
        return self.alphas_cumprod[t]

    def grid(self, steps: int) -> Tensor:
        """[steps + 1] long timesteps, T-1 down to 0, strictly decreasing: step k goes grid[k] -> grid[k+1].

        ``uniform`` spaces timesteps evenly (DDIM's default). ``karras`` spaces the noise level
        sigma_t = sqrt((1 - ab_t) / ab_t) as in EDM (rho = 7) and rounds to the nearest timestep:
        with evenly spaced timesteps a 20-step sampler jumps from sigma 0.17 straight to 0.01, so
        it cannot resolve detail finer than that and few- and many-step samplers disagree.
        """
        if not 1 <= steps < self.num_timesteps:
            raise ValueError(f"steps must be in [1, {self.num_timesteps - 1}], got {steps}")
        if self.spacing == "uniform":
            return torch.linspace(self.num_timesteps - 1, 0, steps + 1, dtype=torch.float64).round().long()
        ab = self.alphas_cumprod.double()
        log_sig = 0.5 * torch.log((1 - ab) / ab)                        # [T] increasing in t
        lo, hi = log_sig[0].exp() ** (1 / self.rho), log_sig[-1].exp() ** (1 / self.rho)
        target = torch.log((hi + torch.linspace(0, 1, steps + 1, dtype=torch.float64) * (lo - hi)) ** self.rho)
        t = (log_sig[None, :] - target[:, None]).abs().argmin(1)
        t[0], t[-1] = self.num_timesteps - 1, 0
        for k in range(steps - 1, 0, -1):                                 # strictly decreasing
            t[k] = max(int(t[k]), int(t[k + 1]) + 1)
        if bool((t[:-1] <= t[1:]).any()):
            raise ValueError(f"steps={steps} is too many for a karras grid over {self.num_timesteps} timesteps")
        return t.long()

    def add_noise(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """Forward process q(x_t | x_0): what the denoising (SFT) objective trains against."""
        ab = self.alpha_bar(t)[:, None]
        return ab.sqrt() * x0 + (1 - ab).sqrt() * noise


DEFAULT_SCHEDULE = NoiseSchedule()


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, diag(std^2)) summed over the last dim: [B, D] x3 (std may broadcast) -> [B]."""
    std = std.expand_as(mean)
    return (-((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI).sum(-1)


def ddim_step(model, x_t: Tensor, t: Tensor | int, t_prev: Tensor | int, cond: Tensor, eta: float,
              generator: torch.Generator | None = None, prev_sample: Tensor | None = None, *,
              schedule: NoiseSchedule = DEFAULT_SCHEDULE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One DDIM step x_t -> x_{t_prev}: sample it (prev_sample=None) or score a given prev_sample.

    x_t [B, D]; t, t_prev int or [B] long with t > t_prev; cond [B, P] prompt ids.
    Returns (prev_sample [B, D], log_prob [B], mean [B, D], std [B, 1]). The log-prob is taken of
    the detached sample, so gradients reach the policy only through ``mean`` (score function).
    """
    b = x_t.shape[0]
    t = torch.as_tensor(t, dtype=torch.long).expand(b)
    t_prev = torch.as_tensor(t_prev, dtype=torch.long).expand(b)
    if bool((t_prev >= t).any()):
        raise ValueError("ddim_step: need t > t_prev for every row")
    if eta < 0:
        raise ValueError(f"ddim_step: eta must be >= 0, got {eta}")
    eps = model(x_t, t, cond)
    ab_t = schedule.alpha_bar(t).to(x_t)[:, None]
    ab_p = schedule.alpha_bar(t_prev).to(x_t)[:, None]
    x0 = (x_t - (1 - ab_t).sqrt() * eps) / ab_t.sqrt()
    variance = (1 - ab_p) / (1 - ab_t) * (1 - ab_t / ab_p)
    std = eta * variance.clamp_min(0).sqrt()
    direction = (1 - ab_p - std**2).clamp_min(0).sqrt() * eps
    mean = ab_p.sqrt() * x0 + direction
    if eta == 0:
        if prev_sample is not None:
            raise ValueError("ddim_step: eta=0 is deterministic and cannot score a given prev_sample")
        return mean, torch.zeros(b, device=x_t.device), mean, std
    if prev_sample is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        prev_sample = mean + std * noise
    prev_sample = prev_sample.detach()
    return prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std


@dataclass
class ContinuousBatch:
    """Recorded continuous trajectories, one row per sample.

    Shapes (B samples, K steps, D latent dims, P prompt width):
      prompt_ids     [B, P] long   right-padded prompt ids (the condition)
      latents        [B, K+1, D]   states x at grid[0] (initial noise) ... grid[K] (the output)
      timesteps      [K+1] long    the grid; step k goes timesteps[k] -> timesteps[k+1]
      logp           [B, K] float  behaviour log-prob of each recorded transition
      group_id, policy_version [B] long; reward, advantage [B] float (NaN = not set yet)
    """

    prompts: list[str]
    prompt_ids: Tensor
    latents: Tensor
    timesteps: Tensor
    logp: Tensor
    eta: float
    group_id: Tensor
    policy_version: Tensor
    reward: Tensor | None = None
    advantage: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        b = len(self.prompts)
        if self.latents.dim() != 3 or self.latents.shape[0] != b:
            raise ValueError(f"ContinuousBatch.latents: expected [{b}, K+1, D], got {tuple(self.latents.shape)}")
        k = self.latents.shape[1] - 1
        checks = {"prompt_ids": (self.prompt_ids, (b, self.prompt_ids.shape[-1])), "timesteps": (self.timesteps, (k + 1,)),
                  "logp": (self.logp, (b, k)), "group_id": (self.group_id, (b,)),
                  "policy_version": (self.policy_version, (b,))}
        for name, (tensor, shape) in checks.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"ContinuousBatch.{name}: expected shape {shape}, got {tuple(tensor.shape)}")
        if self.reward is None:
            self.reward = torch.full((b,), float("nan"))
        if self.advantage is None:
            self.advantage = torch.full((b,), float("nan"))

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel()) - 1

    @property
    def samples(self) -> Tensor:
        """[B, D] the final states (what the reward scores)."""
        return self.latents[:, -1]


@torch.no_grad()
def sample_sde(model, prompts: list[str], prompt_ids: Tensor, steps: int, eta: float, generator: torch.Generator,
               *, schedule: NoiseSchedule = DEFAULT_SCHEDULE, group_id: Tensor | None = None,
               policy_version: int = 0, latent_dim: int | None = None, x_init: Tensor | None = None) -> ContinuousBatch:
    """Stochastic (eta > 0) sampler that records every state and transition log-prob (training)."""
    if eta <= 0:
        raise ValueError(f"sample_sde: eta must be > 0 to record log-probs, got {eta}; use sample_ode for eta=0")
    b = prompt_ids.shape[0]
    d = latent_dim or model.config.latent_dim
    grid = schedule.grid(steps)
    latents = torch.empty(b, steps + 1, d)
    logp = torch.empty(b, steps)
    x = x_init.clone() if x_init is not None else torch.randn(b, d, generator=generator)
    latents[:, 0] = x
    for k in range(steps):
        x, lp, _, _ = ddim_step(model, x, grid[k], grid[k + 1], prompt_ids, eta, generator, schedule=schedule)
        latents[:, k + 1] = x
        logp[:, k] = lp
    return ContinuousBatch(prompts=list(prompts), prompt_ids=prompt_ids.clone(), latents=latents, timesteps=grid,
                           logp=logp, eta=float(eta), group_id=(group_id if group_id is not None else torch.arange(b)).long(),
                           policy_version=torch.full((b,), policy_version, dtype=torch.long))


@torch.no_grad()
def sample_ode(model, prompt_ids: Tensor, steps: int, generator: torch.Generator | None = None, *,
               x_init: Tensor | None = None, schedule: NoiseSchedule = DEFAULT_SCHEDULE,
               latent_dim: int | None = None, order: int = 1) -> Tensor:
    """Deterministic probability-flow ODE sampler with few steps (evaluation): -> [B, D] outputs.

    ``order=1`` is plain DDIM (eta = 0, :func:`ddim_step`), a first-order exponential integrator:
    exact for a point mass but it shrinks the spread of wider data by O(1/steps).
    ``order=2`` is DPM-Solver++(2M): the same one network call per step, DDIM's update with the
    x0 prediction linearly extrapolated in log-SNR from the previous step; first and last steps
    stay first order (the usual ``lower_order_final`` guard for very few steps).
    """
    if order not in (1, 2):
        raise ValueError(f"sample_ode: order must be 1 (DDIM) or 2 (DPM-Solver++ 2M), got {order}")
    b = prompt_ids.shape[0]
    x = x_init if x_init is not None else torch.randn(b, latent_dim or model.config.latent_dim, generator=generator)
    grid = schedule.grid(steps)
    if order == 1:
        for k in range(steps):
            x = ddim_step(model, x, grid[k], grid[k + 1], prompt_ids, 0.0, schedule=schedule)[0]
        return x
    ab = schedule.alpha_bar(grid).double()
    alpha, sigma = ab.sqrt(), (1 - ab).sqrt()
    lam = torch.log(alpha / sigma)
    prev_x0, prev_h = None, None
    for k in range(steps):
        t = grid[k].expand(b)
        x0 = (x - sigma[k].float() * model(x, t, prompt_ids)) / alpha[k].float()
        h = lam[k + 1] - lam[k]
        d = x0
        if prev_x0 is not None and k < steps - 1:
            r = float(prev_h / h)
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * prev_x0
        x = float(sigma[k + 1] / sigma[k]) * x - float(alpha[k + 1] * torch.expm1(-h)) * d
        prev_x0, prev_h = x0, h
    return x
