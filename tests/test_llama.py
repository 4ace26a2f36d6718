"""Llama-Diffusion backend: bidirectional attention, HF checkpoint round trip, tokenizer wrapper,
and one ADPO update through the same path a user's local Hugging Face checkpoint takes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_core.algo.advantages import group_advantages
from miles_core.algo.rows import score_rows
from miles_core.config import ConfigError, load_recipe
from miles_core.models.base import load_checkpoint, save_checkpoint
from miles_core.models.hf_tokenizer import HFTokenizer, char_tokenizer
from miles_core.models.llama import LlamaDiffusion, init_checkpoint, load_llama
from miles_core.models.lora import lora_targets
from miles_core.data.registry import build_task
from miles_core.learner.baseline import train_baseline
from miles_core.learner.policy import Learner


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Llama (hidden 32, 2 layers) saved as a plain HF folder: no mask token yet."""
    return init_checkpoint(tmp_path_factory.mktemp("llama") / "base", hidden=32, layers=2, heads=2, intermediate=64)


def test_later_token_changes_earlier_logits(base_dir):
    """Bidirectional: editing the last token moves position 0's logits, with or without padding.

    Control: the same weights run causally (stock transformers) are blind to the edit, so the
    check would fail if either of the two causal switches (config / attention module) were left on.
    """
    model, tok = load_llama(base_dir)
    model.eval()
    ids = tok.encode("12+3=") + [tok.mask_id] * 4
    x = torch.tensor([ids, [tok.pad_id] * 2 + ids[:-2]])                     # row 1 is left-padded
    attn = torch.tensor([[True] * len(ids), [False] * 2 + [True] * (len(ids) - 2)])
    y = x.clone()
    y[:, -1] = tok.encode("7")[0]
    with torch.no_grad():
        before, after = model(x, attn), model(y, attn)
        causal = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        causal.config.is_causal = True  # the saved config says False (written by LlamaDiffusion)
        causal.resize_token_embeddings(tok.vocab_size, mean_resizing=False)
        causal.load_state_dict(model.lm.state_dict())
        c_before = causal(input_ids=x[:1]).logits
        c_after = causal(input_ids=y[:1]).logits
    assert (before[0, 0] - after[0, 0]).abs().max() > 1e-4          # no padding: mask skipped, still bidirectional
    assert (before[1, 2] - after[1, 2]).abs().max() > 1e-4          # padded row: first real token sees the last
    assert torch.allclose(c_before[0, 0], c_after[0, 0], atol=1e-6)  # control: causal model cannot see it


def test_left_padding_does_not_change_a_rows_logits(base_dir):
    """Positions count real tokens only, so a row's logits do not depend on its batch's pad width."""
    model, tok = load_llama(base_dir)
    ids = torch.tensor([tok.encode("3*4-1") + [tok.mask_id] * 3])
    padded = torch.cat([torch.full((1, 3), tok.pad_id), ids], 1)
    attn = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], 1)
    with torch.no_grad():
        assert torch.allclose(model(ids)[0], model(padded, attn)[0, 3:], atol=1e-5)


def test_mask_token_added_deterministically_and_persisted(base_dir, tmp_path):
    raw = json.loads((base_dir / "config.json").read_text())
    assert raw["model_type"] == "llama"
    m1, tok1 = load_checkpoint(base_dir)
    m2, tok2 = load_checkpoint(base_dir)
    assert tok1.vocab_size == raw["vocab_size"] + 1 and tok1.mask_id == raw["vocab_size"]  # [MASK] appended
    emb = m1.lm.get_input_embeddings().weight
    assert torch.equal(emb[-1], emb[:-1].mean(0))                           # new row: mean, not random
    assert torch.equal(emb, m2.lm.get_input_embeddings().weight)            # two loads (sampler, learner) agree
    save_checkpoint(m1, tok1, tmp_path / "ck")
    m3, tok3 = load_checkpoint(tmp_path / "ck")
    assert tok3.added_tokens == 0 and tok3.mask_id == tok1.mask_id and tok3.hf.mask_token == "[MASK]"
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["vocab_size"] == tok1.vocab_size
    x = torch.tensor([tok1.encode("5+6") + [tok1.mask_id] * 2])
    with torch.no_grad():
        assert torch.equal(m1(x), m3(x))


def test_hf_tokenizer_interface():
    tok = HFTokenizer(char_tokenizer())
    ids = tok.encode("12+3=15")
    assert len(ids) == 7 and tok.decode(ids) == "12+3=15"
    comp = tok.encode_completion("15", 5)
    assert comp[2:] == [tok.eos_id] * 3 and tok.decode(comp + tok.encode("junk")) == "15"
    assert tok.decode(tok.encode("1") + [tok.mask_id] + tok.encode("2")) == "1_2"
    assert tok.eos_id not in tok.forbidden_ids and {tok.pad_id, tok.mask_id} <= set(tok.forbidden_ids)
    with pytest.raises(ValueError, match="does not fit completion_len=2"):
        tok.encode_completion("123", 2)
    hf = char_tokenizer()
    hf.pad_token = hf.eos_token                      # Llama checkpoints often pad with EOS
    assert HFTokenizer(hf).pad_id == HFTokenizer(hf).mask_id  # pad must never forbid EOS
    named = HFTokenizer(char_tokenizer(), mask_token="<|mdm_mask|>")
    assert named.hf.convert_ids_to_tokens(named.mask_id) == "<|mdm_mask|>"


def test_bad_checkpoint_folders_name_the_problem(tmp_path, base_dir):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt9"}))
    with pytest.raises(ValueError, match=r"model_type 'gpt9' is not a known diffusion family \(Dream, a2d-qwen3, "
                                         r"llada, modernbert, qwen3, sdar; also llama and miles-tiny\)"):
        load_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="model.path: only the 'llama' and 'hf' backends"):
        load_recipe("tiny", ["model.path=/x"])
    assert lora_targets(load_llama(base_dir)[0]) == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj")


def test_save_load_sample_update_changes_only_lora(base_dir, tmp_path):
    """The user path: HF folder -> load -> save (as Miles writes an SFT'd base) -> Learner ->
    sample -> scoring reproduces the behaviour log-probs -> one ADPO update moves LoRA only,
    on attention and MLP projections alike."""
    model, tok = load_checkpoint(base_dir)
    save_checkpoint(model, tok, tmp_path / "saved")
    cfg = load_recipe("llama_tiny", ["estimators.adpo.step_fraction=1.0", "update.row_chunk=8", "update.max_grad_norm=1e9",
                                     "train.prompts_per_iter=3"])
    learner = Learner(cfg, tmp_path / "saved")
    assert isinstance(learner.model.get_base_model(), LlamaDiffusion)
    with torch.no_grad():  # non-zero B, so A receives gradient too
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    data = build_task(cfg)
    batch = learner.sample(data, 0)
    assert batch.completion_ids.shape == (12, cfg.task.completion_len) and (batch.step_map >= 0).all()
    assert all(isinstance(c, str) for c in batch.completions)
    k = torch.tensor([0, 5, 11])
    learner.model.eval()
    with torch.no_grad():
        logp, _, commit = score_rows(learner.model, batch, k, batch.step_map[k, 0], learner.tok, cfg.sampler.temperature)
    assert torch.allclose(logp[commit], batch.logp[k][commit], atol=1e-5)
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 3
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = learner.update(batch)
    after = learner.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert stats["rows"] > 0 and changed and all("lora_" in k for k in changed)
    for proj in ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(f"{proj}.lora_" in k for k in changed), proj
    learner.save_adapter(tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)


def test_llama_tiny_recipe_sft_writes_a_transformers_checkpoint(tmp_path):
    cfg = load_recipe("llama_tiny", ["sft.steps=3"])
    model, tok = train_baseline(cfg, build_task(cfg), tmp_path / "sft")
    assert isinstance(model, LlamaDiffusion) and isinstance(tok, HFTokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sft"))     # a standard HF folder
    assert hf.config.hidden_size == 32 and hf.config.num_hidden_layers == 2
    reloaded, tok2 = load_checkpoint(tmp_path / "sft")
    x = torch.tensor([tok.encode("1+2") + [tok.mask_id] * 3])
    with torch.no_grad():
        assert torch.equal(model(x), reloaded(x)) and tok2.mask_id == tok.mask_id
