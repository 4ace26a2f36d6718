"""Reading final answers out of text: GSM8K's ``#### X``, ``\\boxed{X}``, the last number, with
numbers normalised (commas, fractions, percents, LaTeX). It sits in ``data`` because loading a
dataset needs it (GSM8K's reference answers) as much as scoring does; the rewards above import it.
Every function is total: bad text gives None, never an exception (a reward must not kill a batch).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

# A number: optional sign (only when not glued to a preceding digit/letter/paren, so that "5-3"
# yields "3" and "x=-6" yields "-6"), optional "$", digits with comma groups of exactly three,
# optional decimals, optional fraction denominator, optional percent.
_NUM_RE = re.compile(
    r"(?<![\w)\].])(?:[-+\u2212]\s?)?\$?\s?"
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?\s?%?"
    r"|(?<![\w)\].])(?:[-+\u2212]\s?)?\$?\.\d+%?",
    re.ASCII,
)
HASH_RE = re.compile(r"####\s*([^\n]*)")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), honouring nested braces."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts[-8:]):  # bounded: adversarial text cannot make this quadratic
        depth, i = 1, start
        while i < len(text):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
            i += 1
        # Unbalanced: try an earlier \boxed.
    return None


def _clean_latex(s: str) -> str:
    """Turn the little LaTeX that shows up in final answers into plain text."""
    for _ in range(4):  # nested \frac{\frac..}{..} resolves inside-out
        new = _FRAC_RE.sub(r"(\1)/(\2)", s)
        new = _TEXT_RE.sub(r"\1", new)
        if new == s:
            break
        s = new
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\%", "%").replace("\\$", "$").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("{", "").replace("}", "")
    s = re.sub(r"\((-?[\d.]+)\)", r"\1", s)  # "(1)/(2)" -> "1/2"
    return s.strip()


def _parse_number(s: str) -> Fraction | None:
    """Exact value of a number string (ints, decimals, fractions, %, $, commas), else None."""
    if not isinstance(s, str):
        return None
    t = s.strip().replace("\u2212", "-").replace(",", "").replace("$", "").replace(" ", "")
    t = t.rstrip("%").rstrip(".")
    if t.startswith("+"):
        t = t[1:]
    if not t or len(t) > 200:
        return None
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            if not re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", num, re.ASCII) or not re.fullmatch(
                r"\d+\.?\d*|\.\d+", den, re.ASCII
            ):
                return None
            d = Fraction(den)
            return None if d == 0 else Fraction(num) / d
        if not re.fullmatch(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,2})?", t, re.ASCII):
            return None
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _fmt_decimal(v: Fraction) -> str:
    """Canonical decimal text for a value with a terminating expansion (no trailing zeros)."""
    if v.denominator == 1:
        return str(v.numerator)
    sign = "-" if v < 0 else ""
    v = abs(v)
    whole, rem = divmod(v.numerator, v.denominator)
    digits = []
    while rem and len(digits) < 60:
        rem *= 10
        q, rem = divmod(rem, v.denominator)
        digits.append(str(q))
    return f"{sign}{whole}." + "".join(digits).rstrip("0")


def normalize_number(s: str) -> str | None:
    """Canonical text of a number, or None when ``s`` is not a number.

    ``"1,234"``->``"1234"``, ``"$5.00"``->``"5"``, ``"+5"``->``"5"``, ``"-0"``->``"0"``,
    ``"12%"``->``"12"``, ``"6/8"``->``"3/4"`` (fractions stay fractions; they are compared by
    value in :func:`answers_match`). Canonical text lets answers be compared as strings too.
    """
    if not isinstance(s, str):
        return None
    t = s.strip()
    v = _parse_number(t)
    if v is None:
        return None
    if "/" in t and v.denominator != 1:
        return f"{v.numerator}/{v.denominator}"
    if v.denominator == 1 or (_terminates(v) and v.denominator <= 10**40):
        return _fmt_decimal(v)
    return f"{v.numerator}/{v.denominator}"


def _terminates(v: Fraction) -> bool:
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _first_number(s: str) -> str | None:
    m = _NUM_RE.search(s)
    return normalize_number(m.group(0)) if m else None


def _last_number(s: str) -> str | None:
    ms = list(_NUM_RE.finditer(s))
    for m in reversed(ms):
        n = normalize_number(m.group(0))
        if n is not None:
            return n
    return None


def extract_answer(text: str) -> str | None:
    """Final answer of a free-form solution, or None when there is none.

    Priority: last ``\\boxed{...}`` > GSM8K ``#### X`` > the number after the last ``=`` > the
    last number anywhere. Numbers come back normalised (:func:`normalize_number`); a boxed
    non-number comes back as cleaned text so symbolic answers can still be compared as strings.
    """
    if not isinstance(text, str) or not text:
        return None
    try:
        boxed = last_boxed(text)
        if boxed is not None:
            cleaned = _clean_latex(boxed)
            n = normalize_number(cleaned)
            if n is not None:
                return n
            if cleaned:
                return cleaned
        hashes = HASH_RE.findall(text)
        if hashes:
            tail = hashes[-1].strip()
            n = normalize_number(tail)
            if n is None:
                n = _first_number(tail)
            if n is not None:
                return n
        if "=" in text:
            n = _first_number(text[text.rindex("=") + 1 :])
            if n is not None:
                return n
        return _last_number(text)
    except Exception:  # noqa: BLE001 - a reward must never crash a rollout batch
        return None


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", "", _clean_latex(s)).rstrip(".").lower()


def answers_match(pred: str | None, ref: str | None) -> bool:
    """True when two answers agree: numerically (abs tol 1e-6) if both parse, else as text."""
    if pred is None or ref is None:
        return False
    try:
        p, r = str(pred), str(ref)
        pv, rv = _parse_number(_clean_latex(p)), _parse_number(_clean_latex(r))
        if pv is not None and rv is not None:
            return pv == rv or abs(float(pv - rv)) <= 1e-6
        return bool(_norm_text(p)) and _norm_text(p) == _norm_text(r)
    except Exception:  # noqa: BLE001
        return False


def reference_answer(ref: Any) -> str | None:
    """Normalised reference answer; accepts a bare answer, a number, or a full GSM8K solution."""
    if ref is None or isinstance(ref, bool):
        return None
    if isinstance(ref, (int, float)):
        return None if isinstance(ref, float) and not math.isfinite(ref) else normalize_number(repr(ref))
    if not isinstance(ref, str) or not ref.strip():
        return None
    if "####" in ref or "\\boxed" in ref:
        return extract_answer(ref)
    n = normalize_number(ref)
    return n if n is not None else ref.strip()


