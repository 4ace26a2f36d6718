"""What a sandbox run's report means: the run is hostile, so its bytes are bounded, checked for
depth before they are parsed, and trusted for nothing but the statuses a run may claim.

:class:`miles_core.rewards.pool.SandboxPool` turns each worker reply into an ExecResult with
:func:`interpret`; whatever a report holds, these functions return a status and a reason and never
raise (a reward call must not fail on what a completion wrote).
"""

from __future__ import annotations

import json
import signal
from typing import TYPE_CHECKING, Any

from miles_core.rewards import sandbox
from miles_core.rewards.sandbox_tests import PROGRAM_ENDS

if TYPE_CHECKING:
    from miles_core.rewards.jobs import SandboxLimits

# What a run may report about itself: how a program ends, "ok", or the tester's "setup_error" (the
# benchmark's own setup code raised). It cannot claim a failure of the harness (setup_failed,
# worker_error), which the worker alone establishes.
_RUN_STATUSES = PROGRAM_ENDS | {"ok", "setup_error"}
ERROR_CHARS = 200  # of each per-call error a run reports (they reach Score.reason and logs)
REPORT_DEPTH = 64  # nesting a report may have (a tagged value takes two levels per container level)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in a JSON text, outside strings, in time linear in its length
    (checked before parsing: a hostile report nested thousands deep never reaches the parser)."""
    from itertools import accumulate

    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes, then escaped quotes
    brackets = b"".join(plain.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    return max(accumulate(1 if c in b"[{" else -1 for c in brackets), default=0)


def parse_report(body: bytes) -> Any:
    """A run's or a worker's JSON message, or None when it is too deep or not JSON; never raises."""
    if json_depth(body) > REPORT_DEPTH:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # includes JSON and UTF-8 decoding errors
        return None


def interpret(data: bytes, sig: int, code: int, timed_out: bool, lim: "SandboxLimits", setup_ok: bool = True) -> dict:
    if not setup_ok:
        return {"status": "setup_failed", "reason": "the run's sandbox setup failed before the completion ran "
                "(limits, filter or hook); its worker was replaced"}
    if timed_out:
        return {"status": "timeout", "reason": f"timed out after {lim.timeout_s}s wall clock; run killed"}
    if len(data) > lim.result_bytes:
        return {"status": "bad_result", "reason": f"result message larger than {lim.result_bytes} bytes"}
    if sig:
        known = {signal.SIGXCPU: ("cpu_limit", f"CPU time limit ({lim.cpu_s}s) exceeded"),
                 signal.SIGXFSZ: ("output_limit", f"wrote more than {lim.output_bytes} bytes (output/file limit)"),
                 signal.SIGKILL: ("cpu_limit", "killed (SIGKILL): hard CPU limit or out of memory"),
                 signal.SIGSEGV: ("crashed", "segmentation fault (e.g. stack overflow from runaway recursion)")}
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        status, reason = known.get(sig, ("crashed", f"killed by {name}"))
        return {"status": status, "reason": reason}
    body = sandbox.frame_body(data)
    msg = None if body is None else parse_report(body)
    if code == sandbox.VIOLATION_EXIT and isinstance(msg, dict):
        return {"status": "blocked", "reason": str(msg.get("reason", "blocked by sandbox policy"))[:300]}
    if code == 0 and isinstance(msg, dict) and isinstance(msg.get("status"), str):
        if msg["status"] not in _RUN_STATUSES:
            return {"status": "bad_result", "reason": f"the run reported an unknown status {msg['status'][:40]!r}"}
        out = {"status": msg["status"], "reason": str(msg.get("reason", ""))[:300]}
        if msg["status"] == "ok":
            outs, errs = msg.get("outputs"), msg.get("errors")
            if not (isinstance(outs, list) and isinstance(errs, list) and len(outs) == len(errs)):
                return {"status": "bad_result", "reason": "malformed result message"}
            out.update(outputs=[plain(o) for o in outs], errors=[e[:ERROR_CHARS] if isinstance(e, str) else None if e is None else "?"
                                             for e in errs])
        return out
    if data and msg is None:
        why = "a malformed or over-deep result" if body is not None else "a malformed result"
        return {"status": "bad_result", "reason": f"exited with code {code} after writing {why}"}
    return {"status": "exited", "reason": f"exited with code {code} without reporting a result (os._exit/sys.exit?)"}


_KINDS = {"s": "set", "f": "frozenset", "g": "iterator", "G": "iterator", "b": "bytes", "c": "complex", "r": "range",
          "k": "dict_keys", "v": "dict_values", "i": "dict_items", "F": "Fraction", "D": "Decimal", "d": "dict"}


def plain(v: Any) -> Any:
    """A single run's tagged output (sandbox_values._tag) as the JSON value it equals: lists and
    tuples as lists, dicts with str keys as dicts, ints of any size; anything else as
    ``{"__unencodable__": kind}``, which equals no expected value. Never raises on what a run sent."""
    if type(v) is not list:
        return v if v is None or type(v) in (bool, int, float, str) else {"__unencodable__": "malformed"}
    if len(v) != 2 or type(v[0]) is not str:
        return {"__unencodable__": "malformed"}
    tag, items = v
    try:
        if tag in ("l", "t") and type(items) is list:
            return [plain(x) for x in items]
        if tag == "I" and type(items) is str:
            return int(items, 16)
        if tag == "d" and type(items) is list and all(type(p) is list and len(p) == 2 and type(p[0]) is str
                                                      for p in items):
            return {k: plain(x) for k, x in items}
    except (ValueError, RecursionError):
        pass
    return {"__unencodable__": _KINDS.get(tag, str(items)[:40] if tag == "u" else "malformed")}
