"""Named evaluation presets: the sampling settings the field's tables were measured with.

A preset is a recorded set of values, not a hidden default: ``eval.preset=d1`` writes its
generation length, steps, block length, temperature and remasking into the EvalConfig of every
number it produces (and so into the fingerprint). Sources:

* d1 (dllm-reasoning/d1 ``eval/eval.py``, ``eval/run_eval.sh``): block 32, greedy, low-confidence
  remasking, and steps = gen_length / 2 whatever the command line says; lengths 128, 256, 512
  (the stored baselines are 128/64, 256/128, 512/256). ``d1`` is 256, d1's headline setting.
* DARE (yjyddq/DARE ``recipe/llada/run_d1_llada_8b_instruct.sh``): validation runs one token
  per step (steps = length), block 32, temperature 0 for LLaDA, at 512 tokens for math and
  code and 256 for Countdown and Sudoku. DARE also decodes with a Fast-dLLM-style KV cache,
  which Miles' static sampler does not; its numbers are therefore comparable in settings, not in
  decoding implementation.
"""

from __future__ import annotations

from typing import Any

_D1 = {"block_size": 32, "temperature": 0.0, "remasking": "low_confidence"}
PRESETS: dict[str, dict[str, Any]] = {
    "d1_128": {"completion_len": 128, "steps": 64, **_D1},
    "d1": {"completion_len": 256, "steps": 128, **_D1},
    "d1_512": {"completion_len": 512, "steps": 256, **_D1},
    "dare": {"block_size": 32, "temperature": 0.0, "remasking": "low_confidence"},
}
_DARE_LENGTH = {"gsm8k": 512, "math": 512, "math500": 512, "humaneval": 512, "mbpp": 512,
                "countdown": 256, "sudoku": 256}


def preset_values(name: str, task: str) -> dict[str, Any]:
    """completion_len, steps, block_size, temperature, remasking of preset ``name`` for ``task``."""
    if name not in PRESETS:
        raise ValueError(f"eval.preset: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    v = dict(PRESETS[name])
    if name == "dare":
        if task not in _DARE_LENGTH:
            raise ValueError(f"eval.preset=dare: DARE reports no length for task {task!r}; "
                             f"it covers {', '.join(sorted(_DARE_LENGTH))}")
        v["completion_len"] = v["steps"] = _DARE_LENGTH[task]
    return v
