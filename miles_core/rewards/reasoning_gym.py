"""reasoning-gym's own scorer as a reward (the data side, loading its datasets, is
miles_core/data/loaders.py). ``reasoning_gym`` is imported on first use: it is slow to import."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from miles_core.data.answers import extract_answer
from miles_core.data.loaders import reasoning_gym_module
from miles_core.rewards.text import completion_text


@functools.lru_cache(maxsize=64)
def _scorer(name: str) -> Callable[[str | None, dict], float]:
    return reasoning_gym_module().get_score_answer_fn(name)


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
