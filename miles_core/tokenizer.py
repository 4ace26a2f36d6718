"""A character tokenizer for the built-in tasks.

Special ids (pad, mask, eos) come from here and nowhere else: samplers and losses ask the
tokenizer, so a swapped backend (a transformers tokenizer with an added [MASK]) works unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

# Append-only: ids are positions in this string and saved checkpoints depend on them.
# "%|&^~" were appended for Python code (the code task's ``x%3``).
DEFAULT_CHARS = "0123456789+-*/=;()#.,:? abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_[]{}<>!'\"\\\n" "%|&^~"
SPECIALS = ("[PAD]", "[MASK]", "[EOS]", "[UNK]")


# What a chat prompt of a task ends with after the generation prompt: d1 prefills "<reasoning>"
# for its math evaluations (dllm-reasoning/d1 eval/eval.py, add_reasoning=True "for all models").
PROMPT_PREFILL = {"gsm8k": "<reasoning>", "math": "<reasoning>", "math500": "<reasoning>"}


def _countdown_question(prompt: str) -> str:
    """``"3,10:13"`` (countdown's notation, data/countdown.py: the numbers, then the target) asked
    in words. Read here, not through data/countdown.py: the tokenizer sits below the data floor."""
    numbers, _, target = "".join(prompt.split()).partition(":")
    return f"Make {target} from the numbers {' and '.join(numbers.split(','))}, using each once with +, - or *. " \
           "Answer with the equation only."


# The user turn a chat prompt of a task asks, from the task's own prompt text. A bare "6-1-3" sent
# to SmolLM2-135M-Instruct gets a refusal; asked "What is 6-1-3? ..." its greedy answer is right 38%
# of the time on one-operation problems. Countdown's "3,10:13" asked as below gets "3 + 10 = 13"
# (two numbers; benchmarks.real_model's ar_countdown measures the rate).
PROMPT_QUESTION: dict[str, Callable[[str], str]] = {
    "arith": lambda prompt: f"What is {prompt}? Answer with the number.",
    "countdown": _countdown_question,
}


def prompt_question(task: str) -> Callable[[str], str]:
    """The user turn a chat prompt of ``task`` asks (the prompt as it is when the task has none)."""
    return PROMPT_QUESTION.get(task, str)

class CharTokenizer:
    """One id per character plus four specials.

    ``decode`` stops at the first EOS: completions are padded with EOS (LLaDA style), so the
    model itself decides the answer length inside a fixed completion window.
    """

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: chars must be unique")
        self.chars = chars
        self.itos: list[str] = list(SPECIALS) + list(chars)
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        self.pad_id = self.stoi["[PAD]"]
        self.mask_id = self.stoi["[MASK]"]
        self.eos_id = self.stoi["[EOS]"]
        self.unk_id = self.stoi["[UNK]"]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def forbidden_ids(self) -> list[int]:
        """Ids a denoiser must never emit for a completion position."""
        return [self.pad_id, self.mask_id, self.unk_id]

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_id) for c in text]

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i == self.mask_id:
                out.append("_")
            elif i in (self.pad_id, self.eos_id, self.unk_id):
                continue
            else:
                out.append(self.itos[i])
        return "".join(out)

    def encode_prompt(self, text: str) -> list[int]:
        """A task prompt's ids (no chat template: the character model has none)."""
        return self.encode(text)

    def encode_completion(self, text: str, length: int) -> list[int]:
        return eos_padded(self.encode(text), self.eos_id, length, text)

    def save(self, directory: str | Path) -> None:
        """``tokenizer.json`` in the Hugging Face ``tokenizers`` format (a WordLevel vocabulary of one
        entry per character, each character its own pre-token, the four specials as special tokens)
        and ``tokenizer_config.json``, so ``transformers.AutoTokenizer`` opens the folder and encodes
        exactly as :meth:`encode` (left padding, as Miles batches prompts)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        hf = Tokenizer(models.WordLevel(dict(self.stoi), unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIALS))
        hf.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "mask_token": "[MASK]",
             "eos_token": "[EOS]", "unk_token": "[UNK]", "padding_side": "left"}, indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        """Read :meth:`save`'s folder, or the older ``{"type": "char", "chars": ...}`` tokenizer.json."""
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        chars = saved_chars(json.loads(path.read_text()))
        if chars is None:
            raise ValueError(f"{path}: not a Miles character tokenizer (neither type 'char' nor a WordLevel "
                             f"vocabulary starting with {SPECIALS} at ids 0..{len(SPECIALS) - 1})")
        return cls(chars)

    @staticmethod
    def saved_in(directory: str | Path) -> bool:
        """Whether ``directory``'s tokenizer.json is a character tokenizer :meth:`load` reads (a
        family that also takes subword tokenizers asks before choosing)."""
        path = Path(directory) / "tokenizer.json"
        return path.exists() and saved_chars(json.loads(path.read_text())) is not None


def saved_chars(data: dict) -> str | None:
    """The characters of a saved character tokenizer (``tokenizer.json`` parsed), or None when it
    is another tokenizer: the older ``{"type": "char"}`` form, or a WordLevel vocabulary whose ids
    0..3 are :data:`SPECIALS`, contiguous, every other entry one character."""
    if data.get("type") == "char":
        return data["chars"]
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    if model.get("type") != "WordLevel" or not isinstance(vocab, dict):
        return None
    itos = [s for s, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    rest = itos[len(SPECIALS):]
    if tuple(itos[:len(SPECIALS)]) != SPECIALS or sorted(vocab.values()) != list(range(len(itos))) \
            or any(len(c) != 1 for c in rest):
        return None
    return "".join(rest)


def eos_padded(ids: list[int], eos_id: int, length: int, text: str) -> list[int]:
    """A target completion of exactly ``length`` ids: the text's, then EOS (a diffusion model fills
    every position, and EOS is what it learns to put after the answer). Raises naming the text
    when it does not fit, since cutting it would train on a wrong answer."""
    if len(ids) > length:
        raise ValueError(f"completion of {len(ids)} tokens does not fit completion_len={length}: {text!r}")
    return ids + [eos_id] * (length - len(ids))
