"""Every estimator by name: what ``update.estimator`` names, and what the update engine looks up.

Why a registry: an estimator is what a row is, its loss and its advantage transform; the engine
(algo/update.py) only runs rows, so it holds no estimator's name. One module per estimator here
declares all three and registers itself by name with :func:`register_estimator` (as verl's
``core_algos`` registers its policy losses); :func:`get_estimator` finds it. Adding an estimator
is one module, named in ``config.BUILTIN_ESTIMATORS`` (docs/concepts/estimators.md shows one).

Each estimator's knobs are its settings class (``settings``, the recipe's ``estimators.NAME``
section, config/estimators.py); the row builders receive that estimator's settings and nothing of
another's, plus the engine's epoch count (masks are drawn per epoch).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, TypeVar

from torch import Tensor, nn

from miles_core.algo.draws import Draws
from miles_core.algo.loss import TokenRatioLoss
from miles_core.algo.rows import Rows, RowScorer
from miles_core.config import BUILTIN_ESTIMATORS, ConfigError, UpdateConfig, register_settings, unregister_settings
from miles_core.config.schema import Section
from miles_core.tokenizer import CharTokenizer
from miles_core.types import Batch

# (batch of the builder's kind, its estimator's settings, epochs, tok, temperature, draws, model or
# None) -> the rows of the batch and their scorer; every random draw comes from ``draws``'
# per-trajectory generators (algo/draws.py), so a rank holding a share of the batch builds exactly
# its trajectories' rows. A builder takes its own batch class (TrajectoryBatch, RenoiseBatch) and
# settings class; the registry calls it only with those.
RowBuilder = Callable[[Batch, Section, int, CharTokenizer, float, Draws, nn.Module | None], tuple[Rows, RowScorer]]


class Estimator:
    """One estimator: the rows it builds for each kind of batch it supports, its loss and its
    advantage transform. Subclass, set ``settings`` and ``builders``, and decorate with
    :func:`register_estimator`."""

    name: ClassVar[str] = ""
    settings: ClassVar[type]                # its own knobs: a config.Section dataclass (``estimators.NAME``)
    builders: ClassVar[dict[str, RowBuilder]] = {}  # batch kind (TrajectoryBatch.kind ...) -> its rows
    # whether its rows or advantages read a trajectory's group (ESPO's stratified counts, wd1's
    # softmax): then learner ranks are dealt whole groups, else single trajectories (learner/shares.py)
    whole_groups: ClassVar[bool] = False

    def row_builders(self) -> dict[str, RowBuilder]:
        """Batch kind (``TrajectoryBatch.kind``, ``RenoiseBatch.kind``) -> the rows built for it."""
        return dict(self.builders)

    def loss(self, cfg: UpdateConfig) -> Any:
        """The loss module the engine calls on every chunk (algo/loss.py): ADPO's clipped ratio,
        its importance weight capped at ``update.is_cap``, by default."""
        return TokenRatioLoss(cfg.clip_eps, cfg.is_cap, cfg.kl_coef, cfg.entropy_floor, cfg.entropy_coef)

    def advantages(self, adv: Tensor, batch: Batch) -> Tensor:
        """[B] what the loss weights each kept trajectory by, from its advantage [B]: itself by default."""
        return adv

    def rows(self, batch: Batch, own: Section, epochs: int, tok: CharTokenizer, temperature: float,
             draws: Draws, model: nn.Module | None = None) -> tuple[Rows, RowScorer]:
        """The rows of ``batch`` and their scorer, by the batch's kind; a kind this estimator has no
        rows for fails naming both (a renoising chain has no masked states to score an ELBO on)."""
        builders = self.row_builders()
        build = builders.get(batch.kind)
        if build is None:
            can = [e.name for e in _REGISTRY.values() if batch.kind in e.row_builders()]
            raise ValueError(f"update.estimator={self.name!r} builds no rows for a {batch.kind!r} batch ("
                             f"{type(batch).__name__}); estimators that do: {', '.join(map(repr, can))}")
        if not isinstance(own, self.settings):
            raise TypeError(f"estimator {self.name!r} reads {self.settings.__name__}, got {type(own).__name__}")
        return build(batch, own, epochs, tok, temperature, draws, model)


_REGISTRY: dict[str, Estimator] = {}
E = TypeVar("E", bound=type[Estimator])


def register_estimator(name: str) -> Callable[[E], E]:
    """Class decorator: register an :class:`Estimator` subclass under ``name`` (``update.estimator``),
    and its settings class with the recipe schema (a built-in name must bring the class the schema
    states for it)."""
    def deco(cls: E) -> E:
        if name in _REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered ({type(_REGISTRY[name]).__name__})")
        try:
            register_settings(name, cls.settings)
        except AttributeError:
            raise TypeError(f"estimator {name!r} ({cls.__name__}) declares no settings class") from None
        cls.name = name
        _REGISTRY[name] = cls()
        return cls
    return deco


def unregister_estimator(name: str) -> None:
    """Remove ``name`` from the registry (tests registering a toy estimator clean up with this)."""
    _REGISTRY.pop(name, None)
    unregister_settings(name)


def get_estimator(name: str) -> Estimator:
    """The estimator registered under ``name``, or a ConfigError naming ``update.estimator`` and the
    registered names."""
    est = _REGISTRY.get(name)
    if est is None:
        raise ConfigError(f"update.estimator: {name!r} is not a registered estimator; registered: "
                          f"{', '.join(map(repr, sorted(_REGISTRY)))}")
    return est


def estimator_names() -> list[str]:
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    """Import each module ``config.BUILTIN_ESTIMATORS`` names; each must register its own name."""
    import importlib

    for module in BUILTIN_ESTIMATORS:
        importlib.import_module(f"{__name__}.{module}")
        if module not in _REGISTRY:
            raise ImportError(f"{__name__}.{module} did not register an estimator named {module!r}")


_load_builtins()
