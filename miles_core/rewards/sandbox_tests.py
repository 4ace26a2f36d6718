"""The sandbox's two harnesses: a completion's function called on given inputs in one process
(:func:`_harness`, the procedural tasks, whose expected outputs the trainer keeps), and a
benchmark's own test code (HumanEval's ``check``, MBPP's asserts) against a completion, with the
two in separate processes (:func:`_serve` and :func:`_test`).

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
alike. sandbox_worker.py starts its processes; inside the sandbox this is
``_miles_sandbox.sandbox_tests`` (image.py packs the harness with the standard library).
"""

from __future__ import annotations

import os
import sys

from .sandbox import SETUP_OK, _fatal, flush_output, read_frame, send_frame, send_msg, to_json
from .sandbox_values import Opaque, _error_of, _exception, _snapshot, _tag, _untag, _write_back

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

_MUTABLE = (list, dict, set, tuple)
_CHUNK_ITEMS, _CHUNK_S = 4096, 0.002  # a lazy iterator's items per pull: at most this many, or this long


def _serve(job: dict, rep: int, req: int) -> None:
    """The program: define the function, say ready, answer requests until the tester hangs up.

    A request is ``("call", args, kwargs, callables)`` (arguments tagged by the tester: ranges,
    generators, big ints cross too; the test's functions among them stay in the tester, and the
    program gets proxies that ask the tester to run them) or ``("next", k)`` (the next items of
    the live iterator ``k`` it returned). A call's reply carries the value and the arguments it
    mutated, at any depth, so a test that checks an argument after the call sees what the function
    did to it."""
    import marshal
    import time

    live: dict = {}

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
            return _untag(v)
        return call

    def answer(msg: dict) -> None:
        try:
            body = to_json(msg).encode()
        except BaseException as e:  # noqa: BLE001 - e.g. a str with surrogates
            body = to_json({"value": ["u", f"unencodable ({type(e).__name__})"]}).encode()
        flush_output()
        send_frame(rep, body)

    def failed(e: BaseException) -> dict:
        msg = _fatal(e, f"on {job['entry']}(...)")
        if msg is not None:
            report(msg)
        return {"error": _error_of(e)}

    fn = _define(job, report)
    send_frame(rep, b'{"ready":true}')
    while (body := read_frame(req)) is not None:
        request = marshal.loads(body)
        if request[0] == "next":
            it, items, end, t0 = live.get(request[1]), [], None, time.monotonic()
            try:
                while len(items) < _CHUNK_ITEMS and (not items or time.monotonic() - t0 < _CHUNK_S):
                    items.append(_tag(next(it), 0, live))
            except StopIteration:
                end = "stop"
            except BaseException as e:  # noqa: BLE001 - raised where the test iterates
                end = failed(e)["error"]
            answer({"items": items, "end": end})
            continue
        _, args, kwargs, callables = request
        args, kwargs = _untag(args), _untag(kwargs)
        for where, k in callables:
            (kwargs.__setitem__ if type(where) is str else args.__setitem__)(where, proxy(k))
        slots = [*((i, a) for i, a in enumerate(args) if type(a) in _MUTABLE),
                 *((k, a) for k, a in kwargs.items() if type(a) in _MUTABLE)]
        before = [_snapshot(a) for _, a in slots]
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - an ordinary exception is the test's business
            answer(failed(e))
            continue
        answer({"value": _tag(value, 0, live), "mutated": [[w, _tag(a, 0, live)] for (w, a), b in zip(slots, before)
                                                           if _snapshot(a) != b]})
    os._exit(0)


def _define(job: dict, report: "Callable[[dict], None]") -> "Callable[..., Any]":
    """The completion's function (an expression's lambda or a module's ``entry``); ``report`` ends
    the run with the reason when there is none."""
    import builtins

    src, kind, entry, params = job["source"], job["kind"], job["entry"], job["params"]
    try:
        is_expr = kind == "expression"
        if kind == "auto":
            try:
                compile(src, "<completion>", "eval", dont_inherit=True)
                is_expr = True
            except SyntaxError:
                pass
        module = type(sys)("__completion__")  # a real module, as dataclasses and pickle look it up
        sys.modules["__completion__"] = module
        g: dict[str, Any] = module.__dict__
        g["__builtins__"] = builtins
        if is_expr:
            compile(src, "<completion>", "eval", dont_inherit=True)  # a bare expression, nothing that escapes the wrapper
            fn = eval(compile(f"lambda {params}: ({src}\n)", "<completion>", "eval", dont_inherit=True), g)  # noqa: S307 - sandboxed
        else:
            exec(compile(src, "<completion>", "exec", dont_inherit=True), g)  # noqa: S102 - sandboxed
            fn = g.get(entry)
    except BaseException as e:  # noqa: BLE001 - every way of failing becomes a reason
        report(_fatal(e, "while defining the function")
               or {"status": "definition_error", "reason": f"defining the function raised {type(e).__name__}"})
    if not callable(fn):
        report({"status": "definition_error", "reason": f"the completion defines no function {entry!r}"})
    return fn


def _harness(job: dict, out_fd: int) -> None:
    """Define the function from the completion, call it on each input, report, exit."""
    def report(msg: dict) -> None:
        flush_output()
        send_msg(out_fd, msg)
        os._exit(0)
    fn, entry = _define(job, report), job["entry"]
    outputs: list[Any] = []
    errors: list[str | None] = []
    for args in job["inputs"]:
        try:
            outputs.append(_tag(fn(*args)))
            errors.append(None)
        except BaseException as e:  # noqa: BLE001 - an ordinary exception is a failed test
            msg = _fatal(e, f"on {entry}{tuple(args)}")
            if msg is not None:
                report(msg)
            outputs.append(None)
            errors.append(f"raised {type(e).__name__}")
    report({"status": "ok", "reason": "finished", "outputs": outputs, "errors": errors})


# How a program may say it ended; anything else it claims is reported as "exited".
PROGRAM_ENDS = frozenset({"memory_limit", "recursion_limit", "syntax_error", "exited", "definition_error", "blocked"})
SETUP_FAILED_EXIT = 71  # the tester's exit code when the program never finished its setup (trusted: only
#                         the tester's own code exits with it, and the worker reads it from the tester alone)


def _test(job: dict, out: int, req: int, rep: int) -> None:
    """The tester: run the trusted setup, then each test snippet against the forwarding stub."""
    import builtins
    import json
    import marshal

    entry = job["entry"]
    fns: list = []  # the test's functions the program may call back, for the exchange in progress

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

    def exchange(request: tuple) -> dict:
        """Send one request, run the program's calls of the test's functions, return its answer."""
        send_frame(req, marshal.dumps(request))
        while "call" in (msg := reply()):
            try:
                f = fns[int(msg["call"])][1]
                result = marshal.dumps(("ok", _tag(f(*_untag(msg["args"], entry, pull),
                                                     **_untag(msg["kwargs"], entry, pull)))))
            except Exception as e:  # noqa: BLE001 - raised in the program, where the call was made
                result = marshal.dumps(("err", _error_of(e)))
            send_frame(req, result)
        return msg

    def pull(k: int) -> "Any":
        """The program's live iterator ``k``, a chunk of items per round trip."""
        while True:
            msg = exchange(("next", k))
            yield from (_untag(x, entry, pull) for x in msg["items"])
            end = msg["end"]
            if end == "stop":
                return
            if end is not None:
                raise _exception(end, entry)

    def candidate(*args: "Any", **kwargs: "Any") -> "Any":
        fns[:] = [(i, a) for i, a in enumerate(args) if callable(a)] + [(k, a) for k, a in kwargs.items() if callable(a)]
        sent_args, sent_kwargs = list(args), dict(kwargs)
        for k, (where, _) in enumerate(fns):
            (sent_kwargs if type(where) is str else sent_args)[where] = None
        try:
            request = ("call", _tag(sent_args), _tag(sent_kwargs), [(where, k) for k, (where, _) in enumerate(fns)])
            marshal.dumps(request)
        except ValueError:
            raise TypeError("test arguments are not plain data; this harness cannot forward them") from None
        msg = exchange(request)
        if "error" in msg:
            raise _exception(msg["error"], entry)
        for where, new in msg.get("mutated", []):
            old = kwargs.get(where) if type(where) is str else args[int(where)]
            _write_back(old, _untag(new, entry, pull))
        return _untag(msg["value"], entry, pull)
    if os.read(rep, 1) != SETUP_OK:  # the program died before its limits, filter and hook were in place
        send_msg(out, {"status": "setup_failed", "reason": "the program process failed to set up"})
        os._exit(SETUP_FAILED_EXIT)
    if reply().get("ready") is not True:
        report({"status": "bad_result", "reason": "the program's first message was not 'ready'"})
    g: dict = {"__name__": "__test__", "__builtins__": builtins}
    try:
        exec(compile(job["setup"], "<setup>", "exec", dont_inherit=True), g)  # noqa: S102 - dataset code, sandboxed
    except BaseException as e:  # noqa: BLE001
        report({"status": "setup_error", "reason": f"the benchmark's setup code raised {type(e).__name__}"})
    g[entry] = g["candidate"] = candidate
    outputs, errors = [], []
    for src in job["tests"]:
        try:
            exec(compile(src, "<test>", "exec", dont_inherit=True), g)  # noqa: S102 - dataset code, sandboxed
            outputs.append(True)
            errors.append(None)
        except AssertionError:
            outputs.append(False)
            errors.append("assertion failed")
        except Exception as e:  # noqa: BLE001 - a failing test, whatever it raised
            outputs.append(False)
            errors.append(f"raised {type(e).__name__}")
    report({"status": "ok", "reason": "finished", "outputs": outputs, "errors": errors})
