"""Each estimator's own settings: the recipe's ``estimators.NAME`` sections.

An estimator (miles_core/algo/estimators/NAME.py) declares what its rows are; the knobs of those
rows are its settings, one frozen dataclass per estimator, named by what each knob counts there
(d1's mask draws, SPG's copies, ESPO's coupled pairs, EBPO's timesteps); ``draws_field`` names
the one that counts the masks drawn per trajectory (a class without it draws none), which a
comparison at equal update cost sets. The estimator names its class (``Estimator.settings``) and :func:`~miles_core.algo.estimators.register_estimator` checks
the two agree, so each knob has one owner.

Why the classes sit here, below the algorithms, and not in each estimator's module: a recipe is
checked field by field before any work, by the command line in a fraction of a second, and an
estimator module imports torch (about 4 s on the 2-core machine; this module 0.05 s). With the
built-in estimators' settings stated here, that check never depends on which modules some earlier
import happened to load. A program's own estimator registers its settings class with
:func:`register_settings` (``register_estimator`` does it) before it loads a recipe that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from miles_core.config.schema import CUSTOM, ConfigError, Need, Section, bounded, build, did_you_mean


@dataclass(frozen=True)
class AdpoSettings(Section):
    """``adpo``: rows are the recorded denoising steps (algo/estimators/adpo.py)."""

    draws_field: ClassVar[str | None] = None  # no masks drawn: its rows are the recorded steps

    step_fraction: float = bounded(0.5, 1e-09, 1.0)          # rho: rows per trajectory = ceil(rho K), the update's forwards
    step_cover: bool = True             # the rows partition all K steps (every token scored); False: a random rho of the steps
    step_merge: int = bounded(1, 1)                   # s > 1: runs of s steps, a random rho of them (TraceRL shrinkage)
    step_sampling: Literal["uniform", "uncertainty"] = "uniform"  # step_cover=false: which steps are drawn (uncertainty: by 1 - mu, reweighted)
    step_floor: float = bounded(0.05, 1e-3, 1.0)      # uncertainty: the least probability any step is drawn with
    renoise_output: bool = False        # renoising chains: also score the output (last argmax) at the last step's T

    def check(self, need: Need) -> None:
        need(self.step_sampling == "uniform" or (not self.step_cover and self.step_merge == 1), "step_sampling",
             "'uncertainty' draws single steps: it needs step_cover=false and step_merge=1")


@dataclass(frozen=True)
class MeanFieldSettings(Section):
    """``meanfield`` (d1): every token scored in one pass of the fully masked completion."""
    draws_field: ClassVar[str] = "mask_draws"  # the field that counts the masks drawn per trajectory

    mask_draws: int = bounded(1, 1, 64)               # Monte-Carlo prompt-mask draws per trajectory, each a row of weight 1/n
    prompt_mask_prob: float = bounded(0.15, 0.0, 1.0)  # fraction of prompt tokens masked in each draw


@dataclass(frozen=True)
class Wd1Settings(MeanFieldSettings):
    """``wd1``: d1's rows (the same two knobs), a ratio-free group-softmax-weighted loss."""


@dataclass(frozen=True)
class CoupledSettings(Section):
    """``coupled``: a random mask and its complement, both scored (algo/estimators/coupled.py)."""
    draws_field: ClassVar[str] = "mask_draws"

    mask_draws: int = bounded(1, 1, 64)               # coupled mask pairs per trajectory, each pair of weight 1/n


@dataclass(frozen=True)
class SpgSettings(Section):
    """``spg``: SPG's sandwiched bounds over block-wise masked copies (algo/estimators/spg.py)."""
    draws_field: ClassVar[str] = "copies"

    copies: int = bounded(1, 1, 64)                   # J: masked copies per trajectory
    mask_block: int = bounded(0, 0)                   # block length of the block-wise masks (0: the completion is one block)
    prompt_mask_prob: float = bounded(0.15, 0.0, 1.0)  # fraction of prompt tokens masked in each copy
    eubo_beta: float = bounded(1.5, 1.0, 10.0)        # beta of the upper bound (EUBO)
    mix: float = bounded(0.5, 0.0, 1.0)               # weight of the EUBO (vs the ELBO) for trajectories with A <= 0


@dataclass(frozen=True)
class EspoSettings(Section):
    """``espo``: a sequence-level ratio from a stratified ELBO (algo/estimators/espo.py)."""
    draws_field: ClassVar[str] = "pairs"

    pairs: int = bounded(1, 1, 64)                    # coupled mask pairs per trajectory


@dataclass(frozen=True)
class EbpoSettings(Section):
    """``ebpo``: a sequence ratio from an ELBO over block noise (algo/estimators/ebpo.py)."""
    draws_field: ClassVar[str] = "timesteps"

    timesteps: int = bounded(1, 1, 64)                # N: noise levels drawn per trajectory
    mask_block: int = bounded(0, 0)                   # block length of the block-wise masks (0: the completion is one block)


# The built-in estimators' settings, by the name ``update.estimator`` selects; each module of that
# name in miles_core/algo/estimators registers an estimator of it.
BUILTIN_SETTINGS: dict[str, type] = {"adpo": AdpoSettings, "coupled": CoupledSettings, "ebpo": EbpoSettings,
                                     "espo": EspoSettings, "meanfield": MeanFieldSettings, "spg": SpgSettings,
                                     "wd1": Wd1Settings}
BUILTIN_ESTIMATORS: tuple[str, ...] = tuple(sorted(BUILTIN_SETTINGS))
# Every estimator a recipe may name -> its settings class: the built-in ones, and any a program registered.
SETTINGS: dict[str, type] = dict(BUILTIN_SETTINGS)


def register_settings(name: str, cls: type) -> None:
    """Let recipes name estimator ``name``, whose ``estimators.NAME`` section builds ``cls``."""
    if not (dataclasses.is_dataclass(cls) and issubclass(cls, Section)):
        raise TypeError(f"estimator {name!r}: settings must be a frozen dataclass subclassing config.Section, got {cls!r}")
    known = SETTINGS.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"estimator {name!r} already has settings {known.__name__}; got {cls.__name__}")
    SETTINGS[name] = cls


def unregister_settings(name: str) -> None:
    """Forget a program's estimator ``name`` (a built-in one stays)."""
    if name not in BUILTIN_SETTINGS:
        SETTINGS.pop(name, None)


class EstimatorSections(dict):
    """Estimator name -> its settings: the recipe's ``estimators`` section, read-only. Every
    registered estimator is present, at its defaults unless the recipe set it."""

    def __missing__(self, name: str) -> Any:
        if name in SETTINGS:  # registered after the recipe was loaded: its defaults
            return SETTINGS[name]()
        raise KeyError(f"estimators.{name}: no estimator {name!r} is registered{did_you_mean(name, SETTINGS)}")

    def __getattr__(self, name: str) -> Any:  # recipe.estimators.spg, as the YAML writes it
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(str(e)) from None

    def _read_only(self, *_: Any, **__: Any) -> None:
        raise TypeError("a recipe's estimators section is read-only; load a recipe with the override instead")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def build_estimator_sections(value: Any, path: str = "estimators.") -> EstimatorSections:
    """``estimators`` from a mapping of estimator name -> its fields; every registered estimator
    not named is at its defaults. An unknown name or field is refused, naming it."""
    if isinstance(value, EstimatorSections):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{path.rstrip('.')}: expected a mapping of estimator name -> settings, got {value!r}")
    for name in value:
        if name not in SETTINGS:
            raise ConfigError(f"{path}{name}: no estimator {name!r} is registered{did_you_mean(name, SETTINGS, path)}; "
                              f"registered: {', '.join(sorted(SETTINGS))}")
    out = {}
    for name, cls in sorted(SETTINGS.items()):
        given = value.get(name, {})
        if isinstance(given, cls):
            out[name] = given
        elif isinstance(given, dict):
            out[name] = build(cls, given, f"{path}{name}.")
        else:
            raise ConfigError(f"{path}{name}: expected a mapping of {sorted(f.name for f in dataclasses.fields(cls))}, "
                              f"got {given!r}")
    return EstimatorSections(out)


CUSTOM[EstimatorSections] = build_estimator_sections
