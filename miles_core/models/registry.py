"""The model-family registry: every backend's :class:`~miles_core.models.family.Family`, and the
lookups callers use instead of testing a model's type.

``family_named("sdar")`` (``model.family``), ``family_for_checkpoint(config)`` (``auto``: by
config.json's ``model_type``), ``family_of(model)`` (a loaded model, bare or under peft). The
built-in families are registered below in the order ``auto`` tries them; :func:`register_family`
adds another (a backend module of its own; docs/concepts/model-families.md).

This is the top of models/ (.importlinter, contract ``models-layers``): it imports the backends,
and no backend imports it, so a backend never reaches another through the registry.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from miles_core.config import ConfigError
from miles_core.models import diffusion_gemma, hf, llama, tiny
from miles_core.models.family import MASKED, Family, LoadOptions
from miles_core.models.families import SPECS
from miles_core.models.window import inner

_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` (its name must be new); ``auto`` tries it after those registered before it."""
    if family.name in _FAMILIES or family.name == "auto":
        raise ValueError(f"register_family: a family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_named(name: str) -> Family:
    """The family ``model.family`` names; an unknown name is an error listing the known ones."""
    if name not in _FAMILIES:
        raise ConfigError(f"model.family: {name!r} is not a known family ({', '.join(_FAMILIES)}, or auto)")
    return _FAMILIES[name]


def family_for_checkpoint(config: dict[str, Any], family: str = "auto", trust_remote_code: bool = False,
                          where: str = "config.json") -> Family:
    """The family that loads a folder with this config.json: the one named, or (``auto``) the
    first whose ``model_types`` has the config's ``model_type``; an unclaimed model_type loads as
    remote code only with the explicit ``trust_remote_code`` opt-in."""
    if family != "auto":
        return family_named(family)
    mt = config.get("model_type")
    for f in _FAMILIES.values():
        if mt in f.model_types:
            return f
    if trust_remote_code:
        return family_named("remote_code")
    known = sorted(t for f in _FAMILIES.values() if f.name in SPECS for t in f.model_types)
    raise ConfigError(f"{where}: model_type {mt!r} is not a known diffusion family ({', '.join(known)}; also "
                      "llama and miles-tiny); set model.family to load it as one of them")


def _no_load(directory: Any, options: LoadOptions) -> tuple[nn.Module, Any]:
    raise ConfigError("a denoiser built in code has no checkpoint family to load it with")


# A denoiser no family claims (one built in a test or a notebook): the masked-diffusion defaults.
DENOISER = Family("denoiser", load=_no_load, owns=lambda m: True, lora_targets=hf.native_targets,
                  sampler=MASKED, batch_kind=MASKED)


def family_of(model: nn.Module) -> Family:
    """The family of a loaded model (peft unwrapped), or :data:`DENOISER` when none claims it."""
    base = inner(model)
    return next((f for f in _FAMILIES.values() if f.owns(base)), DENOISER)


for _family in (tiny.FAMILY, diffusion_gemma.FAMILY, llama.FAMILY, *hf.FAMILIES):
    register_family(_family)
