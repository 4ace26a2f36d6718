"""Learning-rate multipliers shared by SFT and the ADPO learner (for ``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(warmup: int, schedule: Schedule | str, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier per optimizer step: linear warm-up over ``warmup`` steps, then
    ``schedule``: constant, or a linear / cosine decay that reaches 0 just after the run's last
    step (index ``total_steps - 1``), so every step still moves the weights. A decay lets late
    steps, whose batches are as noisy as the early ones, move the weights less: the last weights
    are the ones a run reports and publishes (ADPO), or the ones a noisy validation curve must not
    catch on an unlucky step (SFT)."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule must be constant, linear or cosine, got {schedule!r}")
    warm, total = max(warmup, 1), max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warm or schedule == "constant":
            return min(1.0, (step + 1) / warm)
        frac = min(1.0, (step - warm + 1) / max(total - warm + 1, 1))  # (0, 1): after warm-up; 1 at total
        return 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return factor
