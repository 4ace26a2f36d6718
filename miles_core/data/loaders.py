"""Loaders for external task data: GSM8K-style JSONL (any fsspec URI) and reasoning-gym.

Everything comes back as :class:`~miles_core.data.arith.Problem` so samplers, rewards and eval
treat procedural and external tasks alike. ``reasoning_gym`` is imported lazily (it is slow to
import and optional).
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from miles_core.data.arith import Problem
from miles_core.data.answers import normalize_number


def _gsm8k_final(answer: str) -> str | None:
    """The text after the last ``####`` (GSM8K's final-answer marker), or None."""
    if "####" not in answer:
        return None
    tail = answer.rsplit("####", 1)[1].strip()
    return tail or None


def load_gsm8k_jsonl(uri: str, storage_options: dict | None = None, limit: int | None = None) -> list[Problem]:
    """Problems from a JSONL file of ``{"question", "answer"}`` rows at a local path or fsspec URI.

    ``Problem.answer`` is the normalised number after ``####``; ``target`` keeps the full worked
    answer (for SFT). Blank lines are skipped; a bad row raises ValueError naming its line number
    and field, because silently skipping rows would change the eval set without anyone noticing.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"load_gsm8k_jsonl: limit must be >= 0, got {limit}")
    out: list[Problem] = []
    with fsspec.open(uri, "r", encoding="utf-8", **(storage_options or {})) as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{uri}: line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{uri}: line {lineno}: expected a JSON object, got {type(row).__name__}")
            for fld in ("question", "answer"):
                if not isinstance(row.get(fld), str) or not row[fld].strip():
                    raise ValueError(f"{uri}: line {lineno}: missing or empty field {fld!r}")
            final = _gsm8k_final(row["answer"])
            if final is None:
                raise ValueError(f"{uri}: line {lineno}: field 'answer' has no '#### <final answer>' marker")
            norm = normalize_number(final)
            meta = {"source": uri, "line": lineno, "task": "gsm8k"}
            meta.update({k: v for k, v in row.items() if k not in ("question", "answer")})
            out.append(
                Problem(
                    prompt=row["question"].strip(),
                    target=row["answer"].strip(),
                    answer=norm if norm is not None else final,
                    meta=meta,
                )
            )
    return out


def reasoning_gym_module() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reasoning-gym is not installed; `pip install reasoning-gym`") from e
    return reasoning_gym


def load_reasoning_gym(name: str, size: int, seed: int, **kwargs: Any) -> list[Problem]:
    """``size`` problems from the reasoning-gym dataset ``name`` (extra kwargs go to its config).

    The raw entry is kept in ``meta["entry"]`` so rewards/reasoning_gym.py can use the
    dataset's own scorer, which knows answer formats (lists, strings, boards) we do not.
    """
    rg = reasoning_gym_module()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"load_reasoning_gym: unknown dataset {name!r}; available: {sorted(DATASETS)}")
    ds = rg.create_dataset(name, size=size, seed=seed, **kwargs)
    out = []
    for i in range(size):
        entry = ds[i]
        ans = str(entry["answer"]) if entry.get("answer") is not None else ""
        out.append(
            Problem(
                prompt=entry["question"],
                target=ans,
                answer=ans,
                meta={"task": "reasoning_gym", "dataset_name": name, "entry": entry, "index": i, "seed": seed},
            )
        )
    return out
