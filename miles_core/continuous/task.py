"""A verifiable continuous task conditioned on a text prompt, its reward, and imperfect demos.

Prompt ``"a=+3 b=-2 s=+1"`` (integers in [-R, R], fixed width so the char encoder sees aligned
fields) asks for v in R^4 satisfying, with alpha = a/R, beta = b/R, sigma = s/R:

    c1 = v0 + v1 - sigma            (linear)
    c2 = v2 - alpha * v3 - beta     (bilinear in the prompt and the answer)
    c3 = v3 - v0 * v1               (nonlinear)

The solution set of a prompt is a curve (v0 = u free), so a policy must learn the constraints,
not memorise a point. Reward = -max_i |c_i| (dense, verifiable); success = max_i |c_i| < tol.

Why demos are imperfect: each demonstration is an exact solution plus Gaussian noise whose scale
makes most of them miss the tolerance. SFT imitates that noise; RL on the verifier can remove it.
This is the continuous analogue of "RL teaches what imitation of noisy data cannot".

The held-out split is a pure function of the prompt text (SHA-256 bucket), so train and test
prompts are disjoint by construction, as in the arithmetic task.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_core.data.spec import in_test_bucket

LATENT_DIM = 4


@dataclass(frozen=True)
class ConstraintTaskConfig:
    int_range: int = 4          # a, b, s drawn from [-R, R]
    tolerance: float = 0.05     # success: max constraint violation below this
    demo_noise: float = 0.04    # std of the Gaussian noise added to each demonstration coordinate


def format_prompt(a: int, b: int, s: int) -> str:
    return f"a={a:+d} b={b:+d} s={s:+d}"


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """``"a=+3 b=-2 s=+1"`` -> (3, -2, 1); anything else is a ValueError naming the prompt."""
    try:
        fields = dict(part.split("=", 1) for part in prompt.split())
        return int(fields["a"]), int(fields["b"]), int(fields["s"])
    except (ValueError, KeyError) as e:
        raise ValueError(f"not a constraint-task prompt (want 'a=+3 b=-2 s=+1'): {prompt!r}") from e


def is_test_prompt(prompt: str) -> bool:
    """True when the prompt (whitespace ignored) is in the held-out test bucket."""
    return in_test_bucket("".join(prompt.split()))


class ConstraintTask:
    """Prompts, splits, exact solutions, noisy demonstrations and the verifier."""

    def __init__(self, cfg: ConstraintTaskConfig | None = None) -> None:
        self.cfg = cfg or ConstraintTaskConfig()
        if self.cfg.int_range < 1 or self.cfg.int_range > 9:
            raise ValueError(f"ConstraintTaskConfig.int_range must be in [1, 9], got {self.cfg.int_range}")
        r = self.cfg.int_range
        self.all_prompts = [format_prompt(a, b, s) for a, b, s in itertools.product(range(-r, r + 1), repeat=3)]

    def split(self, name: str) -> list[str]:
        """All prompts of split ``train`` or ``test`` (deterministic order)."""
        if name not in ("train", "test"):
            raise ValueError(f"ConstraintTask.split: unknown split {name!r}; allowed: 'train', 'test'")
        return [p for p in self.all_prompts if is_test_prompt(p) == (name == "test")]

    def params(self, prompts: list[str]) -> Tensor:
        """[B, 3] (alpha, beta, sigma) = (a, b, s) / R."""
        return torch.tensor([parse_prompt(p) for p in prompts], dtype=torch.float32) / self.cfg.int_range

    def violations(self, prompts: list[str], v: Tensor) -> Tensor:
        """[B, 4] answers -> [B, 3] |c1|, |c2|, |c3|."""
        if v.dim() != 2 or v.shape[1] != LATENT_DIM:
            raise ValueError(f"answers: expected shape [B, {LATENT_DIM}], got {tuple(v.shape)}")
        al, be, si = self.params(prompts).unbind(-1)
        c1 = v[:, 0] + v[:, 1] - si
        c2 = v[:, 2] - al * v[:, 3] - be
        c3 = v[:, 3] - v[:, 0] * v[:, 1]
        return torch.stack([c1, c2, c3], dim=-1).abs()

    def reward(self, prompts: list[str], v: Tensor) -> Tensor:
        """[B] -max violation (0 is perfect)."""
        return -self.violations(prompts, v).max(-1).values

    def success(self, prompts: list[str], v: Tensor) -> Tensor:
        """[B] bool: every constraint within tolerance."""
        return self.violations(prompts, v).max(-1).values < self.cfg.tolerance

    def solutions(self, prompts: list[str], u: Tensor) -> Tensor:
        """Exact solutions on each prompt's curve at free parameter u [B] -> [B, 4]."""
        al, be, si = self.params(prompts).unbind(-1)
        v0, v1 = u, si - u
        v3 = v0 * v1
        return torch.stack([v0, v1, al * v3 + be, v3], dim=-1)

    def demonstrations(self, prompts: list[str], per_prompt: int, seed: int) -> tuple[list[str], Tensor]:
        """Imperfect demos: exact solution (u ~ U[-1, 1]) + N(0, demo_noise^2) per coordinate."""
        g = torch.Generator().manual_seed(seed)
        rep = [p for p in prompts for _ in range(per_prompt)]
        u = torch.rand(len(rep), generator=g) * 2 - 1
        v = self.solutions(rep, u) + self.cfg.demo_noise * torch.randn(len(rep), LATENT_DIM, generator=g)
        return rep, v

    def shuffled(self, prompts: list[str], seed: int) -> list[str]:
        out = list(prompts)
        random.Random(seed).shuffle(out)
        return out
