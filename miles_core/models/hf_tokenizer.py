"""A Hugging Face tokenizer behind the interface of :class:`miles_core.tokenizer.CharTokenizer`.

Samplers, losses, SFT and rewards only ever ask a tokenizer for ``encode``/``decode``/
``encode_completion`` and the special ids (pad, mask, eos, forbidden), so wrapping a
``transformers`` tokenizer with the same attributes is all a Llama backbone needs.

Masked diffusion needs a ``[MASK]`` token. It is taken from the tokenizer when it has one
(``mask_token``, or a named token such as LLaDA's ``<|mdm_mask|>``); otherwise ``[MASK]`` is added
as a special token, and :func:`miles_core.models.llama.load_llama` grows the embeddings to match.
Saving writes the tokenizer with the mask token registered, so every later load finds the same id.
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING, Callable

from miles_core.config import ConfigError

from miles_core.tokenizer import DEFAULT_CHARS, eos_padded

if TYPE_CHECKING:  # transformers loads when a tokenizer does, not when the family registry is read
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

MASK = "[MASK]"
EOS = "[EOS]"


class HFTokenizer:
    """``transformers`` tokenizer with CharTokenizer's interface (see module docstring).

    * ``encode`` adds no BOS/EOS: prompts and completions are plain text spans; the completion
      window is padded with EOS by ``encode_completion`` (LLaDA style), and ``decode`` stops there.
    * ``pad_id`` is the tokenizer's pad token unless it is missing or equal to EOS (common for
      Llama checkpoints); then the mask id stands in. Padded prompt positions are never attended
      to, so their id only matters for ``forbidden_ids``, which must never forbid EOS.
    * ``added_tokens`` counts tokens this wrapper added (mask, eos): the model's embedding
      matrix must have ``vocab_size`` rows.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", mask_token: str | None = None) -> None:
        self.hf = tokenizer
        before = len(tokenizer)
        if mask_token:  # a named token (e.g. '<|mdm_mask|>'): register it as the mask token
            tokenizer.add_special_tokens({"mask_token": mask_token})
        elif tokenizer.mask_token is None:
            tokenizer.add_special_tokens({"mask_token": MASK})
        if tokenizer.eos_token is None:
            tokenizer.add_special_tokens({"eos_token": EOS})
        self.added_tokens = len(tokenizer) - before
        self.mask_id = int(tokenizer.mask_token_id)
        self.eos_id = int(tokenizer.eos_token_id)
        if self.mask_id == self.eos_id:
            raise ValueError(f"tokenizer: mask token {tokenizer.mask_token!r} and eos token are the same id "
                             f"{self.mask_id}; a masked-diffusion tokenizer needs distinct ids")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None and pad != self.eos_id else self.mask_id
        self.unk_id: int | None = int(tokenizer.unk_token_id) if tokenizer.unk_token_id is not None else None
        self.prompt_template = "plain"  # or "chat": set from task.prompt_template by models.base.load_base
        self.prompt_prefill = ""        # chat only: the start of the answer (d1 prefills "<reasoning>")
        # chat only: the user turn asked from the task's prompt (tokenizer.py::PROMPT_QUESTION)
        self.prompt_question: Callable[[str], str] = str

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def forbidden_ids(self) -> list[int]:
        """Ids a denoiser must never emit for a completion position (pad, mask, unk where present)."""
        ids = {self.pad_id, self.mask_id}
        if self.unk_id is not None and self.unk_id != self.eos_id:
            ids.add(self.unk_id)
        return sorted(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        """Text up to the first EOS; a still-masked position reads as '_' (as CharTokenizer)."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i == self.mask_id:
                out.append(self.hf.decode(run, skip_special_tokens=True) + "_")
                run = []
            else:
                run.append(i)
        out.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(out)

    def encode_prompt(self, text: str) -> list[int]:
        """A task prompt's ids: as they are (``prompt_template`` plain), or as one user turn of the
        tokenizer's chat template (``prompt_question`` of the text) with the generation prompt
        and ``prompt_prefill`` appended (chat; instruct models)."""
        if self.prompt_template == "plain":
            return self.encode(text)
        content = self.prompt_question(text)
        out = self.hf.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                          tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids] + (self.encode(self.prompt_prefill) if self.prompt_prefill else [])

    def encode_completion(self, text: str, length: int) -> list[int]:
        return eos_padded(self.encode(text), self.eos_id, length, text)

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(directory))

    @classmethod
    def load(cls, directory: str | Path, mask_token: str | None = None) -> "HFTokenizer":
        """Load the tokenizer files of a local Hugging Face folder (never the network)."""
        d = Path(directory)
        if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise FileNotFoundError(f"{d} holds no Hugging Face tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(d), local_files_only=True), mask_token=mask_token)


def char_tokenizer(chars: str = DEFAULT_CHARS) -> "PreTrainedTokenizerFast":
    """A character-level fast tokenizer built locally (no download): one token per character.

    A BPE model with no merges splits text into single characters; ``Fuse`` joins them back
    without spaces. Used for tests and for random-init toy Llamas on the built-in arithmetic task.
    No mask token on purpose: :class:`HFTokenizer` adds it, the path a real checkpoint takes.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars):
        raise ValueError("char_tokenizer: chars must be unique")
    specials = ["[PAD]", EOS, "[UNK]"]
    vocab = {s: i for i, s in enumerate(specials + list(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token=EOS, unk_token="[UNK]",
                                   clean_up_tokenization_spaces=False)


def load_tokenizer(d: Path, mask_id: int) -> "HFTokenizer":
    """The folder's own tokenizer with the token at ``mask_id`` as [MASK] (tokenizer.json is read
    directly: AutoTokenizer would also read config.json and warn about the published model_type)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (d / "tokenizer.json").exists():
        hf = PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
    else:
        hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    name = hf.convert_ids_to_tokens(mask_id) if 0 <= mask_id < len(hf) else None
    if not isinstance(name, str):
        raise ConfigError(f"{d}: the tokenizer has no token with the mask id {mask_id}")
    return HFTokenizer(hf, mask_token=name)
