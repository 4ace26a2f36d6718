"""An update's two settings objects from one set of keyword arguments, for tests that vary both."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_core.config import SETTINGS, UpdateConfig


def update_and_own(estimator: str = "adpo", draws: int | None = None, where_declared: dict[str, Any] | None = None,
                   **fields: Any) -> tuple[UpdateConfig, Any]:
    """(the engine's UpdateConfig, ``estimator``'s own settings): each field goes to the one of the
    two classes that declares it (neither: a TypeError naming it). ``draws``: the estimator's count
    of masks per trajectory, whatever its settings call it (none for adpo); ``where_declared``:
    fields set only for an estimator whose settings have them (tests parametrised over estimators)."""
    engine = {f.name for f in dataclasses.fields(UpdateConfig)}
    cls = SETTINGS[estimator]
    own_names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - engine - own_names
    if unknown:
        raise TypeError(f"neither UpdateConfig nor {cls.__name__} has {sorted(unknown)}")
    own = {k: v for k, v in fields.items() if k in own_names}
    own.update({k: v for k, v in (where_declared or {}).items() if k in own_names})
    draws_field = getattr(cls, "draws_field", None)  # the field counting its mask draws (none for adpo)
    if draws is not None and draws_field is not None:
        own[draws_field] = draws
    return UpdateConfig(estimator=estimator, **{k: v for k, v in fields.items() if k in engine}), cls(**own)
