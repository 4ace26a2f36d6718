"""Loaders for external task data: GSM8K-style JSONL (any fsspec URI) and reasoning-gym.

Everything comes back as :class:`~miles_core.data.arith.Problem` so samplers, rewards and eval
treat procedural and external tasks alike. ``reasoning_gym`` is imported lazily (it is slow to
import and optional).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Sequence

import fsspec

from miles_core.data.arith import Problem
from miles_core.rewards.math import completion_text, extract_answer, normalize_number


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


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reasoning-gym is not installed; `pip install reasoning-gym`") from e
    return reasoning_gym


def load_reasoning_gym(name: str, size: int, seed: int, **kwargs: Any) -> list[Problem]:
    """``size`` problems from the reasoning-gym dataset ``name`` (extra kwargs go to its config).

    The raw entry is kept in ``meta["entry"]`` so :func:`reasoning_gym_reward` can use the
    dataset's own scorer, which knows answer formats (lists, strings, boards) we do not.
    """
    rg = _rg()
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


@functools.lru_cache(maxsize=64)
def _scorer(name: str) -> Callable[[str | None, dict], float]:
    return _rg().get_score_answer_fn(name)


def _candidates(text: str) -> list[str]:
    """Ways to read a final answer from a completion: <answer> tags, the whole text, our extractor."""
    from reasoning_gym.utils import extract_answer as rg_extract

    cands: list[str] = []
    tagged = rg_extract(text)
    if tagged:
        cands.append(tagged)
    if text.strip():
        cands.append(text.strip())
    ours = extract_answer(text)
    if ours:
        cands.append(ours)
    return cands


def reasoning_gym_reward(
    prompts: Sequence[str],
    completions: Sequence[Any],
    entry: Sequence[dict | None],
    dataset_name: Sequence[str] | str | None = None,
    **_: Any,
) -> list[float | None]:
    """Score with reasoning-gym's own ``score_answer``: the best score over candidate answer readings.

    reasoning-gym's default scorer gives partial credit when the oracle answer is a substring, so a
    verbose completion would score below 1.0; trying the ``<answer>`` tag content and our
    normalised final answer as well gives full credit to a correct final answer. None when the
    entry is missing; 0.0 for any malformed completion or scorer failure.
    """
    if len(entry) != len(completions):
        raise ValueError(f"reasoning_gym_reward: {len(entry)} entries for {len(completions)} completions")
    names = [dataset_name] * len(completions) if dataset_name is None or isinstance(dataset_name, str) else dataset_name
    if len(names) != len(completions):
        raise ValueError(f"reasoning_gym_reward: {len(names)} dataset names for {len(completions)} completions")
    out: list[float | None] = []
    for comp, ent, name in zip(completions, entry, names):
        if not isinstance(ent, dict):
            out.append(None)
            continue
        name = name or (ent.get("metadata") or {}).get("source_dataset")
        if not name:
            out.append(None)
            continue
        score = _scorer(name)
        best = 0.0
        try:
            for cand in _candidates(completion_text(comp)):
                try:
                    best = max(best, float(score(cand, ent)))
                except Exception:  # noqa: BLE001 - third-party scorers can raise on odd input
                    continue
                if best >= 1.0:
                    break
        except Exception:  # noqa: BLE001
            best = 0.0
        out.append(min(max(best, 0.0), 1.0))
    return out
