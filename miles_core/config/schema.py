"""The schema machinery every recipe section uses: bounds declared beside a field, a typed build
from a mapping that names the field it refuses, and each section's own cross-field checks.

A section is a frozen dataclass subclassing :class:`Section`; :func:`build` constructs it from a
mapping (YAML or ``key.sub=value`` overrides), coercing each value to its declared type, checking
its bounds, then calling the section's :meth:`Section.check`. Nothing here knows any section.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import field
from typing import Any, Callable, Literal


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the field."""


Need = Callable[[bool, str, str], None]   # (condition, field, message): a ConfigError naming the field if false


class Section:
    """A recipe section: a frozen dataclass whose cross-field rules are :meth:`check`."""

    def check(self, need: Need) -> None:
        """Rules across this section's fields (single-field ranges are the bounds beside each field)."""


def did_you_mean(word: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``word``, else ''."""
    close = difflib.get_close_matches(str(word), sorted(set(choices)), n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def bounded(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A numeric field with inclusive bounds, declared beside it; :func:`build` checks them by name."""
    return field(default=default, metadata={"bounds": (lo, hi)})


def check_bounds(obj: Any, path: str = "") -> None:
    """Every bounded field of ``obj`` within its bounds, or a ConfigError naming field, value and bounds."""
    for f in dataclasses.fields(obj):
        lo, hi = f.metadata.get("bounds", (None, None))
        v = getattr(obj, f.name)
        if v is None or (lo is None and hi is None):
            continue
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise ConfigError(f"{path}{f.name}: {v!r} is out of bounds {rng}")


# A field whose type builds itself from a mapping (the estimators' sections): type -> its builder.
Builder = Callable[[Any, str], Any]
CUSTOM: dict[type, Builder] = {}


def coerce(path: str, tp: Any, value: Any) -> Any:
    """``value`` as type ``tp`` (a Literal, a section, bool, int, float or str), or a ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not allowed{did_you_mean(value, map(str, allowed))}; "
                              f"allowed values: {', '.join(map(repr, allowed))}")
        return value
    if tp in CUSTOM:
        return CUSTOM[tp](value, f"{path}.")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, got {value!r}")
        return build(tp, value, f"{path}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Construct section ``cls`` from a mapping, rejecting unknown keys by name, then check it."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {full!r}{did_you_mean(key, names, path)}; "
                              f"allowed keys here: {', '.join(sorted(names))}")
        kwargs[key] = coerce(full, hints[key], value)
    obj = cls(**kwargs)
    check_bounds(obj, path)

    def need(cond: bool, field_name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{path}{field_name}: {msg}")
    obj.check(need)
    return obj


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data[a][b]...[z] = value`` for ``dotted`` = ``a.b....z``, making the sections on the way."""
    *path, last = dotted.split(".")
    cur = data
    for k in path:
        nxt = cur.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {k!r} is not a section")
        cur = nxt
    cur[last] = value


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> ``{"a.b....z": value}``: the inverse of :func:`set_dotted`."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
