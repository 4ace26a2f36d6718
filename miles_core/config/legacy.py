"""The recipe keys of the single ``adpo`` section, read into today's sections with a warning.

Recipes written before the split set everything under ``adpo``: the optimiser, the update engine,
the staleness bound and every estimator's knobs, one of which (``mask_samples``) meant four
different counts. Each old key maps to the new key(s) that hold what it meant for the estimator
that read it, so an old recipe, an old override or a stored run's recipe trains exactly as before.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

from miles_core.config.schema import ConfigError, set_dotted

_ENGINE = ("estimator", "clip_eps", "is_cap", "kl_coef", "entropy_floor", "entropy_coef", "std_normalize",
           "skip_zero_variance", "loss_norm", "num_minibatches", "epochs", "row_chunk", "chunk_tokens",
           "grad_checkpointing", "max_grad_norm")
_ADPO_ROWS = ("step_fraction", "step_cover", "step_merge", "step_sampling", "step_floor", "renoise_output")

# adpo.KEY -> the dotted keys now holding it (several: each estimator that read it)
MOVED: dict[str, tuple[str, ...]] = {
    **{k: (f"optim.{k}",) for k in ("lr", "warmup", "lr_schedule")},
    **{k: (f"update.{k}",) for k in _ENGINE},
    **{k: (f"estimators.adpo.{k}",) for k in _ADPO_ROWS},
    "max_staleness": ("async_rl.max_staleness",),
    "mask_samples": ("estimators.meanfield.mask_draws", "estimators.wd1.mask_draws", "estimators.coupled.mask_draws",
                     "estimators.spg.copies", "estimators.espo.pairs", "estimators.ebpo.timesteps"),
    "prompt_mask_prob": ("estimators.meanfield.prompt_mask_prob", "estimators.wd1.prompt_mask_prob",
                         "estimators.spg.prompt_mask_prob"),
    "mask_block": ("estimators.spg.mask_block", "estimators.ebpo.mask_block"),
    "eubo_beta": ("estimators.spg.eubo_beta",),
    "spg_mix": ("estimators.spg.mix",),
}


def moved_key(key: str) -> tuple[str, ...]:
    """The new dotted keys of old key ``adpo.KEY``, or a ConfigError naming it."""
    new = MOVED.get(key)
    if new is None:
        close = difflib.get_close_matches(key, sorted(MOVED), n=1, cutoff=0.6)  # named by where it now lives
        hint = f" (did you mean {' or '.join(map(repr, MOVED[close[0]]))}?)" if close else ""
        raise ConfigError(f"unknown config key 'adpo.{key}'{hint}; the adpo section "
                          "was split into optim, update, async_rl.max_staleness and estimators.NAME "
                          "(docs/reference/recipe.md)")
    return new


def warn(moves: dict[str, tuple[str, ...]], where: str) -> None:
    """One FutureWarning for every old key of one source, each with the key(s) now holding it."""
    if moves:
        said = "; ".join(f"adpo.{old} -> {' and '.join(new)}" for old, new in moves.items())
        warnings.warn(f"{where}: the adpo section is deprecated (split into optim, update, async_rl and "
                      f"estimators.NAME); rewrite {said}", FutureWarning, stacklevel=3)


def migrate(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with its ``adpo`` section's keys moved where they now live (each with a warning);
    a key set both ways is refused, since which one was meant cannot be told."""
    old = data.get("adpo")
    if old is None:
        return data
    if not isinstance(old, dict):
        raise ConfigError(f"adpo: expected a mapping, got {old!r}")
    out = {k: v for k, v in data.items() if k != "adpo"}
    moves = {}
    for key, value in old.items():
        new = moved_key(key)
        for dotted in new:
            cur: Any = out
            for k in dotted.split("."):
                cur = cur.get(k) if isinstance(cur, dict) else None
            if cur is not None:
                raise ConfigError(f"{where}: adpo.{key} and {dotted} are both set; keep {dotted}")
            set_dotted(out, dotted, value)
        moves[key] = new
    warn(moves, where)
    return out
