"""The values that cross the sandbox: one encoder (:func:`_tag`) for whatever leaves a process of
a run, and its inverse (:func:`_untag`) for whoever receives it.

Both harnesses (sandbox_tests.py) use them: the single process reports its return values tagged,
and the two-process harness sends arguments one way and results, mutations, exceptions and lazy
iterators the other. What a receiver builds is made of builtin types only (an exception becomes
its nearest builtin base class with the program's message), so nothing of a completion's classes
ever runs outside its own process. Inside the sandbox it is ``_miles_sandbox.sandbox_values``
(image.py packs the harness with the standard library).
"""

from __future__ import annotations

import sys

from .sandbox import to_json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MAX_ITEMS, _MAX_DEPTH, _MAX_STR, _BIG_INT_BITS = 5_000_000, 50, 64 << 20, 12_000
_SEQ = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_VIEWS = {type({}.keys()): "k", type({}.values()): "v", type({}.items()): "i"}


def _tag(v: "Any", depth: int = 0, live: "dict | None" = None, _t=type) -> "Any":
    """The one encoder of values leaving a program: JSON-able data of exact builtin types, with
    containers as ``[tag, items]``, read with the builtin types' own methods (no override of the
    completion's ever runs on the other side).

    A subclass of a builtin (a namedtuple, a Counter, an IntEnum) goes as its builtin data; ints of
    any size (past ``_BIG_INT_BITS`` as hex text, which JSON's digit limit does not touch);
    ``Fraction`` and ``Decimal`` exactly; ``range`` and dict views keep their kind; an iterator goes
    as the items it yields and how it ended, or, with ``live`` (the two-process harness), as a
    handle the tester pulls items through lazily, so an infinite generator used with ``islice``
    costs only what is taken. Anything else becomes ``["u", type name]``, equal to nothing."""
    t = _t(v)
    if v is None or t is bool or t is float or (t is int and v.bit_length() < _BIG_INT_BITS) or (
            t is str and len(v) <= _MAX_STR):
        return v
    if depth >= _MAX_DEPTH:
        return ["u", t.__name__]
    try:
        if t is int:
            return ["I", format(v, "x")]
        if t in _SEQ and len(v) <= _MAX_ITEMS:
            return [_SEQ[t], [_tag(x, depth + 1, live) for x in v]]
        if t is dict and len(v) <= _MAX_ITEMS:
            return ["d", [[_tag(k, depth + 1, live), _tag(x, depth + 1, live)] for k, x in dict.items(v)]]
        if t is bytes and len(v) <= _MAX_STR:
            return ["b", v.decode("latin-1")]
        if t is complex:
            return ["c", [v.real, v.imag]]
        if t is range:
            return ["r", [v.start, v.stop, v.step]]
        if t in _VIEWS:
            return [_VIEWS[t], [_tag(x, depth + 1, live) for x in v]]
        mod = sys.modules.get(getattr(t, "__module__", ""))
        if t is getattr(mod, "Fraction", None) and mod.__name__ == "fractions":
            return ["F", [_tag(v.numerator), _tag(v.denominator)]]
        if t is getattr(mod, "Decimal", None) and mod.__name__ in ("decimal", "_decimal", "_pydecimal"):
            return ["D", str(v)]
        for base, read in ((int, int.__int__), (float, float.__float__), (str, str.__str__),
                           (bytes, bytes.__bytes__), (list, list.__iter__), (tuple, tuple.__iter__),
                           (set, set.__iter__), (frozenset, frozenset.__iter__), (dict, dict.items)):
            if issubclass(t, base):  # bool is handled above; a subclass is sent as its base data
                got = read(v)
                return _tag(dict(got) if base is dict else base(got) if base in _SEQ else got, depth, live)
        if callable(getattr(t, "__next__", None)):
            if live is not None:  # pulled by the tester, a chunk at a time (sandbox_tests._test's pull)
                live[len(live)] = v
                return ["G", len(live) - 1]
            items, end = [], None
            try:  # what it yields, then how it ended
                for x in v:
                    if len(items) == _MAX_ITEMS:
                        end = "truncated"
                        break
                    items.append(_tag(x, depth + 1))
            except Exception as e:  # noqa: BLE001 - the reader sees it where it would iterate
                end = type(e).__name__
            return ["g", [items, end]]
    except (TypeError, ValueError, OverflowError, AttributeError):  # a hostile subclass or metaclass
        pass
    return ["u", t.__name__]


class Opaque:
    """What the tester sees for a value the program could not send as plain data: equal to
    nothing, unequal to everything, and neither true nor false (``assert x`` and ``assert not x``
    both raise), so no assert passes on it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    def __bool__(self) -> bool:
        raise TypeError(f"the program returned {self.name}, which this harness cannot compare")

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<unencodable {self.name}>"


def _exception(err: "Any", entry: str) -> Exception:
    """The exception the program raised, for the test's ``except`` and ``str(e)``: ``err`` is
    ``[names of its builtin bases, message]`` (or a bare name); the first builtin exception class
    among the bases, with the program's message. StopIteration becomes RuntimeError, as PEP 479
    does for generators (else a ``map`` the test iterates would end silently and pass)."""
    import builtins

    names, message = (err if type(err) is list and len(err) == 2 else [[err], None])
    for name in names if type(names) is list else []:
        cls = getattr(builtins, str(name), None)
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(
                cls, (StopIteration, StopAsyncIteration)):
            try:
                return cls(str(message)) if message is not None else cls(f"raised by {entry}")
            except TypeError:  # an exception class that needs other arguments
                continue
    return RuntimeError(f"{entry} raised {str(names)[:60]}")


def _error_of(e: BaseException) -> list:
    """What the program sends of an exception: its builtin base classes, nearest first, and its
    message (cut at 10,000 characters)."""
    try:
        message = str(e)[:10_000]
    except Exception:  # noqa: BLE001 - a hostile __str__
        message = ""
    return [[c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"][:8], message]


def _replay(items: list, end: "str | None", entry: str) -> "Any":
    """The program's iterator, as a generator of what it yielded (and how it ended)."""
    yield from items
    if end is not None:
        raise _exception(end, entry) if end != "truncated" else RuntimeError(
            f"{entry} returned an iterator of more than {_MAX_ITEMS} items")


def _untag(v: "Any", entry: str = "the program", pull: "Any" = None) -> "Any":
    """Inverse of :func:`_tag`; the receiving side of either direction (from the program the
    reply is hostile: anything odd raises). ``pull(k)``: the tester's lazy iterator over the
    program's live iterator ``k``."""
    if type(v) is not list:
        return v
    tag, items = v
    if tag == "u":
        return Opaque(str(items))
    if tag == "I":
        return int(str(items), 16)
    if tag == "F":
        from fractions import Fraction
        return Fraction(int(_untag(items[0])), int(_untag(items[1])))
    if tag == "D":
        from decimal import Decimal
        return Decimal(str(items))
    if tag == "b":
        return str(items).encode("latin-1")
    if tag == "c":
        return complex(float(items[0]), float(items[1]))
    if tag == "r":
        return range(*(int(x) for x in items))
    if tag == "G" and pull is not None:
        return pull(int(items))
    if tag == "g":
        return _replay([_untag(x, entry, pull) for x in items[0]], None if items[1] is None else items[1], entry)
    if tag == "d" or tag == "i":
        pairs = {_untag(k, entry, pull): _untag(x, entry, pull) for k, x in items}
        return pairs if tag == "d" else pairs.items()
    if tag == "k":
        return dict.fromkeys(_untag(x, entry, pull) for x in items).keys()
    if tag == "v":
        return dict(enumerate(_untag(x, entry, pull) for x in items)).values()
    build = {"l": list, "t": tuple, "s": set, "f": frozenset}[tag]
    return build(_untag(x, entry, pull) for x in items)


def _write_back(old: "Any", new: "Any") -> bool:
    """Make the tester's argument ``old`` equal the program's mutated copy ``new`` in place, at
    any depth (inside tuples too), keeping the identity of nested containers where the shapes
    agree; False if ``old`` is not a container this can update (the caller then replaces it)."""
    if old is new:
        return True
    if type(old) is list and type(new) is list:
        if len(old) != len(new):
            old[:] = [None] * len(new)
        for i, x in enumerate(new):
            if not _write_back(old[i], x):
                old[i] = x
        return True
    if type(old) is dict and type(new) is dict:
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, x in new.items():
            if not (k in old and _write_back(old[k], x)):
                old[k] = x
        return True
    if type(old) is set and type(new) is set:
        old.clear()
        old.update(new)
        return True
    if type(old) is tuple and type(new) is tuple and len(old) == len(new):  # its items cannot be rebound
        return all(_write_back(a, b) or a == b for a, b in zip(old, new))
    return False


def _snapshot(a: "Any") -> "Any":
    """A comparable copy of an argument, to tell whether the call mutated it (at any depth)."""
    import marshal

    try:
        return marshal.dumps(a)
    except ValueError:  # it holds something marshal cannot write: compare its encoding instead
        return to_json(_tag(a))
