"""Llama-Diffusion: a ``transformers`` Llama backbone run as a bidirectional masked-diffusion denoiser.

A masked-diffusion LM (LLaDA style) is a Llama whose attention is not causal: every position sees
every other, prompt and completion alike. In transformers 5 the causal pattern comes from two
places:

1. ``LlamaModel.forward`` builds its mask with ``masking_utils.create_causal_mask``, which falls
   back to ``create_bidirectional_mask`` when ``config.is_causal`` is False;
2. with no padding that bidirectional mask is skipped (``None``), and the SDPA / flash kernels
   then decide causality from an ``is_causal`` flag: the kwarg that 5.24's
   ``merge_with_config_defaults`` derives from ``config.is_causal``, else the attention module's
   own ``is_causal`` attribute (True for ``LlamaAttention``). Were only the mask switched, an
   all-ones mask would silently still be causal.

:func:`make_bidirectional` sets the config flag and every module flag (so it does not depend on
the kwarg plumbing of one transformers release); ``tests/test_llama.py`` proves a later token
changes an earlier position's logits, with and without padding, against a causal control. The
saved ``config.json`` records ``is_causal: false``.

Checkpoints are plain Hugging Face folders (``config.json``, safetensors, tokenizer files): a
user's Llama loads through :func:`load_llama` from a local path (never the network, and
``save_checkpoint`` writes the same layout back), so the SFT'd base a sampler pod loads is a
standard checkpoint. Nothing downloads at run time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from miles_core.models.family import Family, LoadOptions
from miles_core.models.hf_native import PROJECTIONS, make_bidirectional, quiet_progress
from miles_core.models.hf_tokenizer import HFTokenizer, char_tokenizer
from miles_core.models.window import Capabilities, KVCache, WindowDenoiser, hf_window, head_weight_of

if TYPE_CHECKING:  # transformers loads with a model, not when the family registry is read
    from transformers import LlamaForCausalLM

# peft LoRA targets: attention and MLP projections of every decoder layer.
LLAMA_LORA_TARGETS = PROJECTIONS["llama"]


class LlamaDiffusion(WindowDenoiser):
    """logits = model(input_ids [B, T], attention_mask [B, T] bool) -> [B, T, V] (the Denoiser protocol).

    Position ids count real tokens only (``cumsum(mask) - 1``), so a left-padded prompt gets the
    same rotary positions whatever the pad width of its batch: a row's logits do not depend on
    which other rows share its chunk, or rank (the distributed update relies on this).

    Inputs may live on another device than the weights (the samplers build CPU tensors): they
    are moved to the model's device and logits come back on the inputs' device.
    """

    def __init__(self, lm: LlamaForCausalLM) -> None:
        super().__init__()
        self.lm = lm
        make_bidirectional(lm)
        self.config = lm.config  # peft reads model.config (model_type 'llama' picks the LoRA targets)
        # An AR model imported with its shift kept (models/importer.py; Dream's convention) reads
        # position i's prediction from the logits at i - 1; config.json's ``logit_shift`` says which.
        self.shift = bool(getattr(lm.config, "logit_shift", False))
        # Block-causal attention (SDAR / BD3LM; an A2D import with ``--block-size``): bidirectional
        # within blocks of ``block_size`` real positions, causal across them; 0 = full attention.
        self.block_size = int(getattr(lm.config, "block_size", 0) or 0)
        if self.block_size < 0:
            raise ValueError(f"config.json block_size={self.block_size}: must be >= 0 (0: full attention)")

    def capabilities(self) -> Capabilities:
        c = self.config
        return Capabilities(kv_cache=True, native="llama", wraps_lm=True, logit_shift=self.shift,
                            block_size=self.block_size,
                            head_weight=head_weight_of(c.vocab_size, c.hidden_size, c.num_hidden_layers,
                                                       c.intermediate_size))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        t = input_ids.shape[1]
        return self.window(input_ids, mask, (0, t), (0, t))[0].to(input_ids.device)       # [B, T, V]

    def window(self, ids: Tensor, mask: Tensor, query: tuple[int, int], out: tuple[int, int],
               cache: KVCache | None = None, keep: tuple[tuple[int, int], ...] = ()) -> tuple[Tensor, KVCache | None]:
        """miles_core/models/window.py: logits of ``out`` from a bidirectional (or block-causal) pass over ``query``."""
        return hf_window(self.lm, ids, mask, query, out, cache, keep, block_size=self.block_size, shift=self.shift)

    def save_pretrained(self, directory: str | Path) -> None:
        """A standard Hugging Face folder (config.json + model.safetensors), loadable by transformers."""
        with quiet_progress():
            self.lm.save_pretrained(str(directory))


def _grow_vocab(lm: LlamaForCausalLM, new_size: int) -> None:
    """Add embedding rows for tokens the tokenizer gained (mask / eos), deterministically.

    transformers' ``mean_resizing`` samples the new rows at random, so two processes loading the
    same base (a sampler and the learner) would disagree about the mask embedding. New rows are
    the mean of the existing ones instead: identical everywhere, and a neutral starting point that
    SFT then trains (save the SFT'd model, and the learned row is stored with it).
    """
    old = lm.get_input_embeddings().weight.shape[0]
    lm.resize_token_embeddings(new_size, mean_resizing=False)
    with torch.no_grad():
        emb = lm.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(0, keepdim=True)
        head = lm.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != emb.data_ptr():
            head.weight[old:] = head.weight[:old].mean(0, keepdim=True)


def load_llama(directory: str | Path, mask_token: str | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa") -> tuple["LlamaDiffusion", HFTokenizer]:
    """Load a local Hugging Face Llama folder as a bidirectional denoiser plus its tokenizer.

    ``mask_token``: name of the token to use as [MASK] when the tokenizer registers none (e.g.
    '<|mdm_mask|>'); by default the tokenizer's mask token, else '[MASK]' is added.
    """
    d = Path(directory)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"Llama checkpoint {d} has no config.json")
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        raise FileNotFoundError(f"Llama checkpoint {d} has no weights (*.safetensors)")
    from transformers import LlamaForCausalLM

    tok = HFTokenizer.load(d, mask_token=mask_token)
    with quiet_progress():
        lm = LlamaForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=dtype,
                                              attn_implementation=attn_implementation)
    if lm.config.model_type != "llama":
        raise ValueError(f"{d}/config.json: model_type {lm.config.model_type!r} is not 'llama'")
    have = lm.get_input_embeddings().weight.shape[0]
    if tok.vocab_size > have:
        _grow_vocab(lm, tok.vocab_size)
    lm.config.pad_token_id = tok.pad_id
    lm.config.eos_token_id = tok.eos_id
    return LlamaDiffusion(lm), tok


def random_llama(vocab_size: int, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int | None = None,
                 intermediate: int = 64, max_positions: int = 128, seed: int = 0, pad_id: int | None = None,
                 eos_id: int | None = None) -> LlamaDiffusion:
    """A randomly initialised Llama-Diffusion of the given size (tests, toy recipes, GPU checks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                      max_position_embeddings=max_positions, pad_token_id=pad_id, eos_token_id=eos_id,
                      bos_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaDiffusion(LlamaForCausalLM(cfg))


def init_checkpoint(out_dir: str | Path, hidden: int = 32, layers: int = 2, heads: int = 2, intermediate: int = 64,
                    max_positions: int = 128, seed: int = 0) -> Path:
    """Write a random-init Llama + character tokenizer as a plain Hugging Face folder.

    Like most Llama checkpoints it has no mask token: :func:`load_llama` adds one and grows the
    embeddings, the same path a user's checkpoint takes.
    """
    hf = char_tokenizer()
    model = random_llama(len(hf), hidden, layers, heads, None, intermediate, max_positions, seed,
                         pad_id=hf.pad_token_id, eos_id=hf.eos_token_id)
    out = Path(out_dir)
    model.save_pretrained(out)
    hf.save_pretrained(str(out))
    return out


def _load(directory: Path, opts: LoadOptions) -> tuple[nn.Module, HFTokenizer]:
    return load_llama(directory, mask_token=opts.mask_token, dtype=getattr(torch, opts.dtype))


# A Hugging Face Llama folder (config.json model_type "llama") run bidirectionally.
FAMILY = Family("bidir_llama", load=_load, owns=lambda m: isinstance(m, LlamaDiffusion),
                lora_targets=lambda m: LLAMA_LORA_TARGETS, model_types=("llama",),
                init=lambda out, seed: init_checkpoint(out, seed=seed))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m miles_core.models.llama",
                                description="Write a random-init toy Llama-Diffusion checkpoint (HF format).")
    p.add_argument("command", choices=["init"])
    p.add_argument("out", help="output folder")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = init_checkpoint(a.out, a.hidden, a.layers, a.heads, a.intermediate, a.max_positions, a.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
