"""Load, run, save and create family checkpoints (see families.py) through native transformers classes.

:class:`HFDiffusion` is the Denoiser for every family: ``logits = model(input_ids [B, T],
attention_mask [B, T] bool) -> [B, T, V]``.

* Positions count real tokens only (``cumsum(mask) - 1``), and block boundaries of block-causal
  families follow those positions, so a row's logits do not depend on its batch's padding.
* Every pass goes through ``window`` (miles_core/models/window.py), which hands the backbone a bool 4D
  mask (True = may attend) that transformers passes to every layer as-is
  (masking_utils._preprocess_mask_arguments): ``[B, 1, 1, Tk]`` real keys for full attention
  (``config.is_causal=False`` and every module's flag are set too, see models/llama.py), and
  ``[B, 1, Tq, Tk]`` "same or earlier block" for block-causal families. Keys may come from a cache.
* Dream's shift: the prediction for position i is read from the logits at i - 1 (a row's first
  real token reads its own, as Dream's position 0 does, so left padding changes nothing).

Checkpoints are read and written in the family's *published* layout (config.json field names,
safetensors tensor names), so a Miles SFT checkpoint of LLaDA is again a LLaDA folder. A folder
whose tensors do not map completely is an error listing the unmapped, missing and misshapen ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from miles_core.config import ConfigError
from miles_core.models.checkpoint import save_tensors
from miles_core.models.families import SPECS, FamilySpec, family_for
from miles_core.models.family import Family, LoadOptions
from miles_core.models.hf_native import PROJECTIONS, make_bidirectional, model_inputs
from miles_core.models.hf_tokenizer import HFTokenizer, load_tokenizer
from miles_core.models.window import (Capabilities, KVCache, Out, Span, WindowDenoiser, head_weight_of, hf_window,
                                      select_out)

_NATIVE = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM")}


def native_classes(spec: FamilySpec) -> tuple[type, type]:
    import transformers

    cfg_name, model_name = _NATIVE[spec.native]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


class HFDiffusion(WindowDenoiser):
    """A native transformers LM run as a masked-diffusion denoiser of one family (module docstring)."""

    def __init__(self, lm: nn.Module, spec: FamilySpec, block_size: int = 4,
                 published: dict[str, Any] | None = None, source: Path | None = None) -> None:
        super().__init__()
        self.lm, self.spec, self.block_size = lm, spec, int(block_size)
        self.published = dict(published or {})
        self.source = source  # the folder it was loaded from: its auto_map code files travel with a save
        self.config = lm.config  # peft reads model.config.model_type for the LoRA targets
        if spec.attention == "full":
            make_bidirectional(lm)

    def capabilities(self) -> Capabilities:
        s, c = self.spec, self.lm.config
        return Capabilities(kv_cache=s.native != "modernbert", block_size=self.block_size if s.attention == "block" else 0,
                            logit_shift=s.logit_shift, native=s.native, wraps_lm=True,
                            to_published=s.to_published if s.renames else None,
                            to_native=s.to_native if s.renames else None,
                            head_weight=head_weight_of(c.vocab_size, c.hidden_size, c.num_hidden_layers,
                                                       c.intermediate_size))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.spec.native == "modernbert":  # natively bidirectional, its own masked-LM head
            ids, mask, pos = model_inputs(self.lm, input_ids, attention_mask)
            return self.lm(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False,
                           is_causal=False).logits.to(input_ids.device)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        t = input_ids.shape[1]
        return self.window(input_ids, mask, (0, t), (0, t))[0].to(input_ids.device)       # [B, T, V]

    def window(self, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None = None,
               keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
        """miles_core/models/window.py: logits of ``out`` from a pass over ``query`` (block-causal for sdar)."""
        if self.spec.native == "modernbert":
            if cache is not None or keep:
                raise ValueError("modernbert has no KV cache here: use sampler.cache=none")
            return select_out(self.forward(ids, mask), out), None
        bs = self.block_size if self.spec.attention == "block" else 0
        return hf_window(self.lm, ids, mask, query, out, cache, keep, block_size=bs, shift=self.spec.logit_shift)

    def published_state_dict(self) -> dict[str, Tensor]:
        out = {}
        tied = tied_keys(self.lm)
        for k, v in self.lm.state_dict().items():
            if k in tied:
                continue
            name = self.spec.to_published(k)
            if name is None:
                raise ValueError(f"{self.spec.name}: no published name for native tensor {k!r}")
            out[name] = v.detach().cpu().contiguous()
        return out

    def save_pretrained(self, directory: str | Path) -> None:
        """The family's published layout, with what its published folder carries for loading:
        config.json (its field names, ``torch_dtype`` the dtype the tensors are stored in),
        model.safetensors, generation_config.json (Dream's ``from_pretrained`` always reads one),
        and the ``auto_map`` code files of the folder it was loaded from (a config naming code the
        folder lacks would make the official loader fail; without the files, no ``auto_map``)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cfg = {**self.published, **self.spec.published_config(self.lm.config.to_dict())}
        if self.spec.attention == "block":
            cfg["block_size"] = self.block_size
        state = self.published_state_dict()
        cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        cfg.pop("dtype", None)
        code = _auto_map_files(cfg.get("auto_map") or {})
        if code and self.source is not None and all((self.source / f).exists() for f in code):
            for f in code:
                if (self.source / f).resolve() != (d / f).resolve():
                    shutil.copyfile(self.source / f, d / f)
        else:
            cfg.pop("auto_map", None)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        (d / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **gen}, indent=2))
        save_tensors(state, d / "model.safetensors", metadata={"format": "pt"})


def _auto_map_files(auto_map: dict[str, Any]) -> list[str]:
    """The code files an ``auto_map`` names (``"modeling_dream.DreamModel"`` -> modeling_dream.py)."""
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(r, str)]
    return sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs})


def tied_keys(lm: nn.Module) -> set[str]:
    """State-dict keys that are the input embedding again (a tied LM head / decoder): not stored."""
    if not getattr(lm.config, "tie_word_embeddings", False):
        return set()
    emb = lm.get_input_embeddings().weight
    keys = [k for k, v in lm.state_dict(keep_vars=True).items() if v is emb]
    return set(keys[1:])  # the first is the embedding itself


def read_tensors(d: Path) -> dict[str, Tensor]:
    """Every tensor of a folder's safetensors files (single file or shards)."""
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {d} has no *.safetensors weights")
    out: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def map_state_dict(spec: FamilySpec, tensors: dict[str, Tensor], want: dict[str, Tensor],
                   where: str) -> dict[str, Tensor]:
    """Published tensors -> the native state dict; every key accounted for, or an error naming them."""
    mapped, unmapped = {}, []
    for k, v in tensors.items():
        n = spec.to_native(k)
        (unmapped.append(k) if n is None or n not in want else mapped.__setitem__(n, v))
    missing = sorted(set(want) - set(mapped))
    shapes = [f"{k}: {tuple(mapped[k].shape)} in the file, {tuple(want[k].shape)} expected"
              for k in sorted(set(mapped) & set(want)) if mapped[k].shape != want[k].shape]
    if unmapped or missing or shapes:
        parts = [f"unmapped tensors {sorted(unmapped)[:8]}" if unmapped else "",
                 f"missing tensors {missing[:8]}" if missing else "", f"wrong shapes {shapes[:4]}" if shapes else ""]
        raise ValueError(f"{where}: the {spec.name} checkpoint does not map completely onto "
                         f"{spec.native}: " + "; ".join(p for p in parts if p))
    return mapped


def load_family(directory: str | Path, family: str = "auto", dtype: torch.dtype = torch.float32
                ) -> tuple[HFDiffusion, HFTokenizer]:
    """A local family folder as a denoiser plus its own tokenizer (never the network)."""
    d = Path(directory)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"checkpoint folder {d} has no config.json")
    published = json.loads((d / "config.json").read_text())
    spec = family_for(published, family, str(d / "config.json"))
    cfg_cls, lm_cls = native_classes(spec)
    config = cfg_cls(**spec.native_config(published))
    config._attn_implementation = "sdpa"
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below (or the load fails): skip random init
        lm = lm_cls(config)
    lm.tie_weights()         # a tied decoder / LM head is the embedding again (not stored, not loaded)
    tied = tied_keys(lm)
    want = {k: v for k, v in lm.state_dict().items() if k not in tied}
    state = map_state_dict(spec, read_tensors(d), want, str(d))
    lm.load_state_dict(state, strict=not tied)
    lm.to(dtype).eval()
    mask_id = int(published.get("mask_token_id") or _own_mask_id(d) or spec.mask_id)
    tok = load_tokenizer(d, mask_id)
    if tok.mask_id != mask_id:
        raise ConfigError(f"{d}: the tokenizer's mask token has id {tok.mask_id}, config.json says {mask_id}")
    if tok.vocab_size > config.vocab_size:
        raise ConfigError(f"{d}: the tokenizer has {tok.vocab_size} tokens, the embedding only {config.vocab_size}")
    return HFDiffusion(lm, spec, int(published.get("block_size", 4)), published, d), tok


def _own_mask_id(d: Path) -> int | None:
    """The mask token the folder's tokenizer registers itself (tokenizer_config / special tokens map)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = d / name
        if f.exists():
            tok = json.loads(f.read_text()).get("mask_token")
            text = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(text, str) and (d / "tokenizer.json").exists():
                vocab = json.loads((d / "tokenizer.json").read_text())
                ids = [a["id"] for a in vocab.get("added_tokens", []) if a.get("content") == text]
                if ids:
                    return int(ids[0])
    return None


def tiny_tokenizer(spec: FamilySpec, vocab_size: int) -> Any:
    """A character-level fast tokenizer of ``vocab_size`` entries with the family's special tokens
    at their published ids (the rest reserved), so ids in tests are the real checkpoint's ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from miles_core.tokenizer import DEFAULT_CHARS

    specials = dict(spec.special_tokens)
    own_unk = "[UNK]" in specials.values()  # ModernBERT has its own [UNK]; the others get one at 0
    vocab = {**({} if own_unk else {"[UNK]": 0}), **{c: i + int(not own_unk) for i, c in enumerate(DEFAULT_CHARS)}}
    for i in range(len(vocab), vocab_size):
        vocab[specials.get(i, f"<|reserved_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    eos = specials[spec.eos_id]
    bos = {"bos_token": specials[spec.bos_id]} if spec.bos_id is not None else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=eos, pad_token=eos,
                                 mask_token=specials[spec.mask_id], clean_up_tokenization_spaces=False, **bos)
    hf.chat_template = spec.chat_template
    return hf


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256}
VOCAB = {"llada": 126464, "dream": 152064, "sdar": 151936, "bidir_qwen3": 151936, "modernbert": 50368}


def _draw_every_tensor(lm: nn.Module, seed: int) -> None:
    """Norm weights, biases and the pad row drawn at random too (a fresh model has ones, zeros and
    a zero pad row), so parity tests see a swapped or dropped mapping of any of them."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() == 1:
                p.copy_(float("norm" in name) + 0.2 * torch.randn(p.shape, generator=g))
        pad = getattr(lm.config, "pad_token_id", None)
        emb = lm.get_input_embeddings().weight
        if pad is not None and 0 <= pad < emb.shape[0]:
            emb[pad] = 0.02 * torch.randn(emb.shape[1], generator=g)


def init_tiny(family: str, out_dir: str | Path, seed: int = 0, size: dict[str, Any] | None = None,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write a tiny random-init checkpoint in ``family``'s published layout: its config.json field
    names, its safetensors tensor names, and a tokenizer with its special tokens at their ids.
    ``size`` overrides the tiny dimensions (native config field names; benchmarks/speed/rollout.py, and
    the GPU check's LLaDA-8B shape, written in ``dtype`` bfloat16 as the published weights are)."""
    if family not in VOCAB:
        raise ConfigError(f"--family: {family!r} has no tiny layout; one of {', '.join(VOCAB)}")
    spec = SPECS[family]
    cfg_cls, lm_cls = native_classes(spec)
    if spec.native == "modernbert":  # its published checkpoints tie the decoder to the embeddings
        extra = {"tie_word_embeddings": True, "pad_token_id": 50283, "eos_token_id": 50282, "bos_token_id": 50281,
                 "cls_token_id": 50281, "sep_token_id": 50282}
    else:
        extra = {"tie_word_embeddings": False, "eos_token_id": spec.eos_id, "pad_token_id": spec.eos_id,
                 "bos_token_id": None, "num_key_value_heads": 2, **({"head_dim": 8} if spec.native == "qwen3" else {})}
    config = cfg_cls(vocab_size=VOCAB[family], **{**TINY, **extra, **(size or {})})
    if spec.native == "llama":
        config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    torch.manual_seed(seed)
    model = HFDiffusion(lm_cls(config).to(dtype), spec)
    _draw_every_tensor(model.lm, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    tiny_tokenizer(spec, VOCAB[family]).save_pretrained(str(out))
    return out


class RemoteCodeDiffusion(WindowDenoiser):
    """``model.family=remote_code``: a folder's own modeling code (``auto_map`` in its config.json),
    run as a bidirectional denoiser through transformers' Auto classes. An explicit opt-in
    (``model.trust_remote_code=true``): it executes Python that ships with the checkpoint, and
    code written for transformers 4 may not run under 5. Logits as the model returns them."""

    # the config names remote code uses for a head_weight_of's sizes (LLaDA's own: d_model, n_layers,
    # mlp_hidden_size); the first one a config sets counts
    SIZES = {"vocab": ("vocab_size", "embedding_size"), "hidden": ("hidden_size", "d_model"),
             "layers": ("num_hidden_layers", "n_layers"), "mlp": ("intermediate_size", "mlp_hidden_size", "d_ff")}

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def capabilities(self) -> Capabilities:
        """No cache (a full forward per call), the folder's model_type; what its logits weigh when
        its config names its sizes in one of :attr:`SIZES`' ways, else 0 (only positions count)."""
        conf = self.config.to_dict()
        size = {k: next((conf[n] for n in names if conf.get(n)), 0) for k, names in self.SIZES.items()}
        weight = (head_weight_of(size["vocab"], size["hidden"], size["layers"], size["mlp"] or 4 * size["hidden"])
                  if size["vocab"] and size["hidden"] and size["layers"] else 0.0)
        return Capabilities(native=str(conf.get("model_type", "")), wraps_lm=True, head_weight=weight)

    def window(self, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None = None,
               keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
        """A full forward sliced to ``out`` (remote code exposes no per-position pass)."""
        if cache is not None or keep:
            raise ValueError("remote_code has no KV cache: use sampler.cache=none")
        return select_out(self.forward(ids, mask), out), None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        dev = next(self.lm.parameters()).device
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
        out = self.lm(input_ids=input_ids.to(dev), attention_mask=mask.to(dev).long())
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.to(input_ids.device)                                              # [B, T, V]

    def save_pretrained(self, directory: str | Path) -> None:
        self.lm.save_pretrained(str(directory))  # copies the modeling files along (auto_map)


def load_remote_code(directory: str | Path, trust_remote_code: bool) -> tuple[RemoteCodeDiffusion, HFTokenizer]:
    d = Path(directory)
    if not trust_remote_code:
        raise ConfigError(f"{d}: model.family=remote_code runs the Python code shipped in the checkpoint; set "
                          "model.trust_remote_code=true to allow it (the published families need no remote code)")
    import transformers

    published = json.loads((d / "config.json").read_text())
    auto_map = published.get("auto_map") or {}
    for name in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"):
        if name in auto_map:
            lm = getattr(transformers, name).from_pretrained(str(d), trust_remote_code=True, local_files_only=True)
            break
    else:
        raise ConfigError(f"{d}/config.json: auto_map names no AutoModelForMaskedLM, AutoModelForCausalLM or "
                          f"AutoModel class (it has {sorted(auto_map)}); nothing to load as remote code")
    mask_id = published.get("mask_token_id")
    tok = load_tokenizer(d, int(mask_id)) if mask_id is not None else HFTokenizer.load(d)
    return RemoteCodeDiffusion(lm.eval()), tok


def _spec_family(spec: FamilySpec) -> Family:
    """The registry's record of one published-layout family (families.py's spec)."""
    return Family(spec.name, load=lambda d, o: load_family(d, spec.name, dtype=getattr(torch, o.dtype)),
                  owns=lambda m: isinstance(m, HFDiffusion) and m.spec.name == spec.name,
                  lora_targets=lambda m: PROJECTIONS[spec.native], model_types=spec.model_types,
                  init=(lambda out, seed: init_tiny(spec.name, out, seed)) if spec.name in VOCAB else None)


def native_targets(model: nn.Module) -> tuple[str, ...]:
    """A native architecture's projections when the model's config names one (remote code, a
    denoiser built in code), else the common ``q/k/v/o_proj, fc1, fc2`` set."""
    native = str(getattr(model.config, "model_type", ""))
    return PROJECTIONS.get(native, ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"))


def _remote_load(d: Path, o: LoadOptions) -> tuple[RemoteCodeDiffusion, HFTokenizer]:
    return load_remote_code(d, o.trust_remote_code)


# The published families, then remote code (picked by name, or under ``auto`` with
# ``trust_remote_code`` for a model_type no family claims; its module names are unknown).
FAMILIES: tuple[Family, ...] = (*(_spec_family(s) for s in SPECS.values()), Family(
    "remote_code", load=_remote_load, owns=lambda m: isinstance(m, RemoteCodeDiffusion),
    lora_targets=native_targets))
