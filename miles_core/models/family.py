"""What the rest of Miles asks of a model family, as one record per family.

Why a record instead of branches: loading, LoRA, sampling, evaluation, serving and storage each
need to know what a family is without testing for one by name (and the loader without trying
every family in turn). Each backend module (models/tiny.py, llama.py, hf.py, diffusion_gemma.py)
describes itself with a :class:`Family`,
models/registry.py collects them, and callers look the family up (``family_of(model)``,
``family_named(name)``) and use its fields. Adding a family is one backend module ending in a
``Family`` plus one line in the registry (docs: "Adding a model family").

This module sits at the bottom of models/ so that backends can build their record without
importing the registry that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

# the masked-diffusion sampler (samplers/sampler.py) and its TrajectoryBatch (types.py)
MASKED = "masked"


@dataclass(frozen=True)
class LoadOptions:
    """The recipe's model settings a loader may read (``model.mask_token``, ``model.dtype``,
    ``model.trust_remote_code``)."""

    mask_token: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Family:
    """One model family.

    ``load(folder, options) -> (model, tokenizer)``; ``owns(model)``: whether a loaded (peft-
    unwrapped) model is one of this family's; ``lora_targets(model)``: peft's ``target_modules``
    when the recipe names none (module names, or one full-match regex); ``model_types``: the config.json
    ``model_type`` values ``model.family=auto`` picks it for; ``sampler``: the samplers/ scheme that
    draws its rollouts (samplers/registry.py); ``batch_kind``: the ``kind`` of the trajectory batch
    that sampler records (types.py), which the learner and the store dispatch on; ``init(out,
    seed)``: a tiny random-init checkpoint (``python -m miles_core.models init``); ``smoke(model,
    tok)``: the facts and one forward ``miles models check`` prints (None: the masked forward)."""

    name: str
    load: Callable[[Path, LoadOptions], tuple[nn.Module, Any]]
    owns: Callable[[nn.Module], bool]
    lora_targets: Callable[[nn.Module], tuple[str, ...] | str]
    model_types: tuple[str, ...] = ()
    sampler: str = MASKED
    batch_kind: str = MASKED
    init: Callable[[Path, int], Path] | None = None
    smoke: Callable[[nn.Module, Any], dict[str, Any]] | None = None
