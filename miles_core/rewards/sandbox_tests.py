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
    from miles_core.rewards.sandbox import SETUP_OK, _define, _fatal, os, read_frame, send_frame, send_msg, to_json
except ImportError:  # pragma: no cover - the sandbox interpreter has no miles_core
    pass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MAX_ITEMS, _MAX_DEPTH, _MAX_STR = 100_000, 50, 1_000_000


def _tag(v: "Any", depth: int = 0, _t=type) -> "Any":
    """A return value as JSON-able data of exact builtin types; containers as ``[tag, items]``.
    Subclasses and other objects become ``["u", type name]``, which equals nothing in the tester."""
    t = _t(v)
    if v is None or t is bool or t is float or (t is int and v.bit_length() < 12_000) or (
            t is str and len(v) <= _MAX_STR):
        return v
    if depth < _MAX_DEPTH:
        if t in (list, tuple, set, frozenset) and len(v) <= _MAX_ITEMS:
            return [{list: "l", tuple: "t", set: "s", frozenset: "f"}[t], [_tag(x, depth + 1) for x in v]]
        if t is dict and len(v) <= _MAX_ITEMS:
            return ["d", [[_tag(k, depth + 1), _tag(x, depth + 1)] for k, x in dict.items(v)]]
        if t is bytes and len(v) <= _MAX_STR:
            return ["b", v.decode("latin-1")]
        if t is complex:
            return ["c", [v.real, v.imag]]
    return ["u", t.__name__]


class Opaque:
    """What the tester sees for a value the program could not send as plain data: equal to nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<unencodable {self.name}>"


def _untag(v: "Any") -> "Any":
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
    if tag == "d":
        return {_untag(k): _untag(x) for k, x in items}
    build = {"l": list, "t": tuple, "s": set, "f": frozenset}[tag]
    return build(_untag(x) for x in items)


def _serve(job: dict, rep: int, req: int) -> None:
    """The program: define the function, say ready, answer calls until the tester hangs up."""
    import marshal

    def report(msg: dict) -> None:
        send_frame(rep, to_json({"fatal": msg}).encode())
        os._exit(0)
    fn = _define(job, report)
    send_frame(rep, b'{"ready":true}')
    while (body := read_frame(req)) is not None:
        args, kwargs = marshal.loads(body)
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - an ordinary exception is the test's business
            msg = _fatal(e, f"on {job['entry']}(...)")
            if msg is not None:
                report(msg)
            send_frame(rep, to_json({"error": type(e).__name__}).encode())
            continue
        try:
            send_frame(rep, to_json({"value": _tag(value)}).encode())
        except BaseException as e:  # noqa: BLE001 - e.g. a str with surrogates, a float subclass
            send_frame(rep, to_json({"value": ["u", f"unencodable ({type(e).__name__})"]}).encode())
    os._exit(0)


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
        try:
            body = marshal.dumps((args, kwargs))
        except ValueError:
            raise TypeError("test arguments are not plain data; this harness cannot forward them") from None
        send_frame(req, body)
        msg = reply()
        if "error" in msg:
            cls = getattr(builtins, str(msg["error"]), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    raise cls(f"raised by {job['entry']}")
                except TypeError:  # an exception class that needs other arguments
                    pass
            raise RuntimeError(f"{job['entry']} raised {str(msg['error'])[:60]}")
        return _untag(msg["value"])
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
