"""Model families: published diffusion-LM checkpoints mapped onto native transformers classes.

A family is a transformers 5 architecture that ships in the library (Llama, Qwen2, Qwen3) plus a
small spec: how the published ``config.json`` fields and tensor names map onto it, the attention
pattern (full bidirectional, or block-causal with a block size), the logit shift, the special
token ids and the chat template. No remote code is needed for these families
(``trust_remote_code`` written for transformers 4 breaks under 5, LLaDA issue #130).

Every fact below was read from public code; the source follows it.

* **llada** (GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5): an OLMo-derived Llama-like block
  (ZHZisZZ/dllm ``dllm/pipelines/llada/models/modeling_llada.py``; NVlabs/Fast-dLLM
  ``llada/model/``). Tensors ``model.transformer.{wte, blocks.N.{attn_norm, q_proj, k_proj,
  v_proj, attn_out, ff_norm, ff_proj, up_proj, ff_out}, ln_f, ff_out}``; the MLP is
  ``ff_out(silu(ff_proj(x)) * up_proj(x))``, so ff_proj is Llama's gate and ff_out its down
  projection. RMSNorm weight-only, eps ``rms_norm_eps``; RoPE over the full head with Llama's
  rotate_half convention (no weight permutation). Attention bidirectional (``is_causal=False``),
  no logit shift (ML-GSAI/LLaDA ``generate.py`` reads logits at the masked positions).
  [MASK] ``<|mdm_mask|>`` 126336, EOS ``<|endoftext|>`` 126081 (also pad), EoT ``<|eot_id|>``
  126348, BOS 126080 (config.json and tokenizer_config.json of LLaDA-8B-Instruct).
* **dream** (Dream-org/Dream-v0-Instruct-7B, apple DiffuCoder-7B): Qwen2 tensors and config
  (``model_type: "Dream"``; q/k/v with bias), bidirectional attention, logits shifted by one:
  ``logits = cat([logits[:, :1], logits[:, :-1]], 1)`` (``generation_utils.py`` ``_sample``, in
  ZHZisZZ/dllm and Fast-dLLM ``dream/model/``). Mask ``<|mask|>`` 151666, pad/EOS 151643.
* **sdar** (JetLM/SDAR-*-Chat, Gen-Verse/TraDo): Qwen3 tensors (q_norm/k_norm), ``model_type:
  "sdar"``, block-causal attention: bidirectional within a block of ``block_size`` (4) positions,
  causal across blocks (JetAstra/SDAR ``generate.py``: ``tril(ones(nb, nb))`` repeated
  ``block_length`` times on both axes); no logit shift. Mask ``<|MASK|>`` 151669, EOS 151643.
* **bidir_qwen3**: Qwen3 converted to masked diffusion (dllm-hub's
  ``Qwen3-0.6B-diffusion-mdlm-v0.1``, ``model_type`` ``qwen3`` or ``a2d-qwen3``; plain Qwen3
  tensors, ZHZisZZ/dllm ``dllm/pipelines/a2d/``): the native layout, full bidirectional attention.
  (**bidir_llama**, a Llama run bidirectionally, is models/llama.py.)
* **modernbert** (ModernBERT-chat conversions such as dllm-hub's ``ModernBERT-{base,large}-chat-v0.1``,
  ZHZisZZ/dllm ``examples/bert/``): transformers' own ``ModernBertForMaskedLM`` (``model_type:
  "modernbert"``, decoder tied to the embeddings), natively bidirectional (global plus local
  sliding-window layers), no logit shift. [CLS] 50281, [SEP] 50282 (used as EOS), [PAD] 50283
  (answerdotai/ModernBERT-base special_tokens_map.json, as quoted in public code); [MASK] 50284 is
  not verified from a primary file: a real folder's own tokenizer decides the mask id.

What was verified here: tiny random-init checkpoints written in each family's published layout
(:mod:`miles_core.models.hf`), loaded through the same path a user's download takes, with
parity against the native class. What needs the real weights: every figure on a real model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from miles_core.config import ConfigError

# model.family (config.ModelConfig) names these specs, plus bidir_llama (models/llama.py, which also
# adds a mask token to a tokenizer that has none), tiny (models/tiny.py) and remote_code (hf.py).
LLADA_CHAT = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
              "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
              "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class FamilySpec:
    """How one published family maps onto a native transformers architecture."""

    name: str
    native: Literal["llama", "qwen2", "qwen3", "modernbert"]  # the transformers model_type it runs as
    model_types: tuple[str, ...]                    # published config.json model_type values (auto)
    attention: Literal["full", "block"]
    logit_shift: bool                               # prediction for i read at i-1 (Dream)
    mask_id: int                                    # published defaults; config.json's fields win
    eos_id: int
    eot_id: int | None
    special_tokens: dict[int, str]                  # id -> token text of the published tokenizer
    chat_template: str
    bos_id: int | None = None                       # the chat template's bos_token (LLaDA)
    # published tensor prefix -> native prefix, "{i}" for the layer index; empty: same names
    renames: tuple[tuple[str, str], ...] = ()
    native_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda d: d)
    published_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda d: d)

    def to_native(self, key: str) -> str | None:
        """The native name of a published tensor; None when no rule maps it."""
        return _rename(key, [(p, n) for p, n in self.renames]) if self.renames else key

    def to_published(self, key: str) -> str | None:
        return _rename(key, [(n, p) for p, n in self.renames]) if self.renames else key


def _rename(key: str, rules: list[tuple[str, str]]) -> str | None:
    for src, dst in rules:
        pat = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + r"\.(weight|bias)$"
        m = re.match(pat, key)
        if m:
            out = dst.replace("{i}", m.group(1)) if "{i}" in src else dst
            return f"{out}.{m.group(m.lastindex)}"
    return None


_LLADA_RENAMES = (
    ("model.transformer.wte", "model.embed_tokens"),
    ("model.transformer.blocks.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
    ("model.transformer.blocks.{i}.q_proj", "model.layers.{i}.self_attn.q_proj"),
    ("model.transformer.blocks.{i}.k_proj", "model.layers.{i}.self_attn.k_proj"),
    ("model.transformer.blocks.{i}.v_proj", "model.layers.{i}.self_attn.v_proj"),
    ("model.transformer.blocks.{i}.attn_out", "model.layers.{i}.self_attn.o_proj"),
    ("model.transformer.blocks.{i}.ff_norm", "model.layers.{i}.post_attention_layernorm"),
    ("model.transformer.blocks.{i}.ff_proj", "model.layers.{i}.mlp.gate_proj"),   # the gate: silu(ff_proj x)
    ("model.transformer.blocks.{i}.up_proj", "model.layers.{i}.mlp.up_proj"),
    ("model.transformer.blocks.{i}.ff_out", "model.layers.{i}.mlp.down_proj"),
    ("model.transformer.ln_f", "model.norm"),
    ("model.transformer.ff_out", "lm_head"),
)
# LLaDA config fields whose values the Llama mapping cannot represent: field -> required value.
_LLADA_REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "alibi": False, "rope": True,
                   "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False,
                   "block_group_size": 1, "include_qkv_bias": False}


def _llada_native(d: dict[str, Any]) -> dict[str, Any]:
    """LLaDA's config.json (OLMo field names) -> LlamaConfig kwargs; unsupported values are errors."""
    for k, want in _LLADA_REQUIRED.items():
        if k in d and d[k] != want:
            raise ConfigError(f"config.json: LLaDA field {k}={d[k]!r} is not supported (the llama mapping needs {want!r})")
    if d.get("activation_type", "silu") not in ("silu", "swiglu"):
        raise ConfigError(f"config.json: LLaDA field activation_type={d['activation_type']!r} is not supported (silu)")
    for k in ("d_model", "n_heads", "n_layers"):
        if k not in d:
            raise ConfigError(f"config.json: LLaDA checkpoint lacks the field {k!r}")
    hidden = int(d["d_model"])
    return {"vocab_size": int(d.get("embedding_size") or d["vocab_size"]), "hidden_size": hidden,
            "intermediate_size": int(d.get("mlp_hidden_size") or d.get("mlp_ratio", 4) * hidden),
            "num_hidden_layers": int(d["n_layers"]), "num_attention_heads": int(d["n_heads"]),
            "num_key_value_heads": int(d.get("n_kv_heads") or d["n_heads"]),
            "max_position_embeddings": int(d.get("max_sequence_length", 4096)),
            "rope_theta": float(d.get("rope_theta", 10000.0)), "rms_norm_eps": float(d.get("rms_norm_eps", 1e-5)),
            "tie_word_embeddings": bool(d.get("weight_tying", False)), "attention_bias": bool(d.get("include_bias")),
            "mlp_bias": bool(d.get("include_bias")), "pad_token_id": d.get("pad_token_id"),
            "eos_token_id": d.get("eos_token_id"), "bos_token_id": None}


def _llada_published(c: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig (as a dict) -> LLaDA's published config.json fields (what a release carries)."""
    return {"architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
            "block_type": "llama", "layer_norm_type": "rms", "rope": True, "alibi": False,
            "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False, "block_group_size": 1,
            "d_model": c["hidden_size"], "n_heads": c["num_attention_heads"],
            "n_kv_heads": c["num_key_value_heads"], "n_layers": c["num_hidden_layers"],
            "mlp_hidden_size": c["intermediate_size"], "mlp_ratio": 4, "vocab_size": c["vocab_size"],
            "embedding_size": c["vocab_size"], "max_sequence_length": c["max_position_embeddings"],
            "rope_theta": c["rope_parameters"]["rope_theta"], "rms_norm_eps": c["rms_norm_eps"],
            "weight_tying": c["tie_word_embeddings"], "include_bias": c["attention_bias"], "include_qkv_bias": False,
            "mask_token_id": 126336, "eos_token_id": c.get("eos_token_id", 126081),
            "pad_token_id": c.get("pad_token_id", 126081), "use_cache": False}


def _drop_keys(extra: tuple[str, ...]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A config.json in the native field names -> native kwargs: drop the published wrapper's own keys."""
    drop = {"model_type", "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", *extra}
    return lambda d: {k: v for k, v in d.items() if k not in drop}


def _qwen_published(model_type: str, arch: str, extra: dict[str, Any],
                    defaults: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Native Qwen config -> the family's published config.json: ``extra`` fields the published
    forward reads (SDAR: ``fuse_cross_entropy``), ``defaults`` for ids the native config leaves
    unset (SDAR-4B-Chat's ``bos_token_id`` 151643)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "hidden_act", "attention_bias", "pad_token_id", "eos_token_id", "bos_token_id", "rope_parameters")

    def out(c: dict[str, Any]) -> dict[str, Any]:
        d = {k: c[k] for k in keep if k in c}
        d["rope_theta"] = d.pop("rope_parameters", {}).get("rope_theta", 10000.0)
        d.update({k: v for k, v in (defaults or {}).items() if d.get(k) is None})
        return {"architectures": [arch], "model_type": model_type, **d, **extra, "use_cache": False}
    return out


def _native_published(c: dict[str, Any]) -> dict[str, Any]:
    """A family whose published config.json is the native one: the config's own fields."""
    drop = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "is_causal"}
    return {"architectures": ["ModernBertForMaskedLM"], **{k: v for k, v in c.items() if k not in drop}}


QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
SPECS: dict[str, FamilySpec] = {
    "llada": FamilySpec(
        "llada", "llama", ("llada",), "full", False, mask_id=126336, eos_id=126081, eot_id=126348,
        special_tokens={126080: "<|startoftext|>", 126081: "<|endoftext|>", 126336: "<|mdm_mask|>",
                        126346: "<|start_header_id|>", 126347: "<|end_header_id|>", 126348: "<|eot_id|>"},
        chat_template=LLADA_CHAT, bos_id=126080, renames=_LLADA_RENAMES, native_config=_llada_native,
        published_config=_llada_published),
    "dream": FamilySpec(
        "dream", "qwen2", ("Dream",), "full", True, mask_id=151666, eos_id=151643, eot_id=151645,
        special_tokens={**QWEN_SPECIALS, 151665: "<|beginoftext|>", 151666: "<|mask|>"}, chat_template=CHATML,
        native_config=_drop_keys(("mask_token_id",)),
        published_config=_qwen_published("Dream", "DreamModel", {"mask_token_id": 151666})),
    "sdar": FamilySpec(
        "sdar", "qwen3", ("sdar",), "block", False, mask_id=151669, eos_id=151643, eot_id=151645,
        special_tokens={**QWEN_SPECIALS, 151669: "<|MASK|>"}, chat_template=CHATML,
        native_config=_drop_keys(("mask_token_id",)),
        published_config=_qwen_published("sdar", "SDARForCausalLM", {"block_size": 4, "mask_token_id": 151669,
                                                                     "fuse_cross_entropy": True},
                                         {"bos_token_id": 151643})),
    "bidir_qwen3": FamilySpec(
        "bidir_qwen3", "qwen3", ("qwen3", "a2d-qwen3"), "full", False, mask_id=151669, eos_id=151643,
        eot_id=151645, special_tokens={**QWEN_SPECIALS, 151669: "<|mask|>"}, chat_template=CHATML,
        native_config=_drop_keys(("is_causal", "mask_token_id")),
        published_config=_qwen_published("qwen3", "Qwen3ForCausalLM", {"is_causal": False})),
    "modernbert": FamilySpec(
        "modernbert", "modernbert", ("modernbert",), "full", False, mask_id=50284, eos_id=50282, eot_id=None,
        special_tokens={50280: "[UNK]", 50281: "[CLS]", 50282: "[SEP]", 50283: "[PAD]", 50284: "[MASK]"},
        chat_template="", native_config=_drop_keys(()), published_config=_native_published),
}


def family_for(config: dict[str, Any], family: str = "auto", where: str = "config.json") -> FamilySpec:
    """The spec for ``family``, or (``auto``) the one whose published model_type the config has."""
    if family != "auto":
        if family not in SPECS:
            raise ConfigError(f"model.family: {family!r} is not a published-layout family ({', '.join(SPECS)})")
        return SPECS[family]
    mt = config.get("model_type")
    for spec in SPECS.values():
        if mt in spec.model_types:
            return spec
    known = sorted(t for s in SPECS.values() for t in s.model_types)
    raise ConfigError(f"{where}: model_type {mt!r} is not a known diffusion family ({', '.join(known)}; also "
                      "llama and miles-tiny); set model.family to load it as one of them")
