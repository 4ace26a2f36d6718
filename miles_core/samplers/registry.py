"""Which sampler draws a model's rollouts: the one its family names (models/family.py ``sampler``).

Why a table here and not a callable on the family: the samplers call the models' window and
canvas forwards, so they sit on a floor above models/ (.importlinter) and a family cannot import
its sampler. It names it instead, and rollout, evaluation and serving ask :func:`sample_for`.
Every sampler takes the same arguments: both sampling sections of the recipe (``sampler`` for the
masked families, ``renoise`` for a renoising one), of which each reads its own, and an in-flight
refresh, which only the masked sampler honours (a renoising one refuses it).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from miles_core.config import RenoiseConfig, SamplerConfig
from miles_core.models.registry import family_of
from miles_core.samplers import renoise, sampler

SampleFn = Callable[..., Any]


def _masked(model: Any, tok: Any, ids: list[list[int]], cfg: SamplerConfig, renoise_cfg: RenoiseConfig,
            completion_len: int, generator: torch.Generator, group_id: Tensor | None, policy_version: int,
            threshold: float | None, refresh: sampler.Refresh | None) -> Any:
    return sampler.sample(model, tok, ids, cfg, completion_len, generator, group_id, policy_version, threshold,
                          refresh=refresh)


def _renoise(model: Any, tok: Any, ids: list[list[int]], cfg: SamplerConfig, renoise_cfg: RenoiseConfig,
             completion_len: int, generator: torch.Generator, group_id: Tensor | None, policy_version: int,
             threshold: float | None, refresh: sampler.Refresh | None) -> Any:
    if refresh is not None:
        raise ValueError("in-flight refresh (async_rl.refresh_every) swaps adapters between masked-diffusion steps; "
                         "a renoising family's sampler does not refresh: set async_rl.refresh_every=0")
    return renoise.sample_seeded(model, tok, ids, renoise_cfg, completion_len, generator, group_id, policy_version)


# family.sampler -> the function that draws and records a batch
SAMPLERS: dict[str, SampleFn] = {"masked": _masked, "renoise": _renoise}


def sample_for(model: Any, tok: Any, ids: Sequence[list[int]], cfg: SamplerConfig, completion_len: int,
               generator: torch.Generator, group_id: Tensor | None = None, policy_version: int = 0,
               threshold: float | None = None, renoise_cfg: RenoiseConfig | None = None,
               refresh: sampler.Refresh | None = None) -> Any:
    """A recorded batch of completions for ``ids`` from the sampler ``model``'s family names
    (a TrajectoryBatch, or a RenoiseBatch for a renoising family; ``batch.kind`` says which);
    ``refresh``: in-flight adapter refresh between steps (masked samplers only)."""
    name = family_of(model).sampler
    if name not in SAMPLERS:
        raise ValueError(f"model family {family_of(model).name!r} names the sampler {name!r}; "
                         f"samplers/registry.py knows {sorted(SAMPLERS)}")
    return SAMPLERS[name](model, tok, list(ids), cfg, renoise_cfg or RenoiseConfig(), completion_len, generator,
                          group_id, policy_version, threshold, refresh)
