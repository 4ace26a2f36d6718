"""model.device: the setting, its errors, and (where torch sees a GPU) the whole loop on it.

CI has no GPU, so the GPU test below is skipped there; it is run on a GPU machine by hand
(``pytest tests/test_device.py``) and its result is recorded in the closing notes."""

from __future__ import annotations

import pytest
import torch

from miles_core.algo.advantages import group_advantages
from miles_core.config import ConfigError, SamplerConfig, load_recipe
from miles_core.models.base import load_checkpoint, resolve_device
from miles_core.models.lora import load_adapter
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.samplers.sampler import sample
from miles_core.data.registry import build_task
from miles_core.learner.baseline import train_baseline
from miles_core.learner.policy import Learner
from miles_core.tokenizer import CharTokenizer

TOK = CharTokenizer()
HAS_CUDA = torch.cuda.is_available()


def test_device_setting_is_checked_by_name():
    with pytest.raises(ConfigError, match=r"model.device: 'tpu' is not one of cpu, cuda, cuda:N, auto"):
        load_recipe("tiny", ["model.device=tpu"])
    for ok in ("cpu", "cuda", "cuda:1", "auto"):
        assert load_recipe("tiny", [f"model.device={ok}"]).model.device == ok
    assert load_recipe("tiny").model.device == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without a GPU")
def test_asking_for_a_gpu_without_one_is_an_error_not_a_silent_cpu_run(tmp_path):
    with pytest.raises(RuntimeError, match=r"model.device='cuda', but torch .* sees no CUDA device"):
        resolve_device("cuda")
    cfg = load_recipe("tiny", ["model.device=cuda:0"])
    with pytest.raises(RuntimeError, match=r"model.device='cuda:0'"):
        train_baseline(cfg, build_task(cfg), tmp_path / "sft")
    assert not (tmp_path / "sft").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_the_loop_runs_on_the_gpu_and_matches_the_cpu(tmp_path):
    """Weights on the GPU, samplers' tensors on the CPU: logits agree with the CPU model's, the
    prefix-cache path works, SFT and an ADPO update run there, and what they save loads on a CPU."""
    torch.manual_seed(0)
    cpu_model = TinyDenoiser(TinyConfig(TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48))
    gpu_model = TinyDenoiser(cpu_model.config)
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.to("cuda")
    ids = torch.randint(4, TOK.vocab_size, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, :5] = False
    out = gpu_model(ids, mask)
    assert out.device.type == "cpu"  # logits come back where the inputs are
    torch.testing.assert_close(out, cpu_model(ids, mask), atol=1e-4, rtol=1e-4)
    prompts = [TOK.encode(p) for p in ("1+2", "3*4")]
    s = SamplerConfig(steps=4, block_size=4, cache="prefix", temperature=0.0)
    b_gpu = sample(gpu_model, TOK, prompts, s, 8, torch.Generator().manual_seed(0), torch.arange(2))
    b_cpu = sample(cpu_model, TOK, prompts, s, 8, torch.Generator().manual_seed(0), torch.arange(2))
    assert torch.equal(b_gpu.completion_ids, b_cpu.completion_ids) and torch.equal(b_gpu.step_map, b_cpu.step_map)
    torch.testing.assert_close(b_gpu.logp, b_cpu.logp, atol=1e-4, rtol=1e-4)

    cfg = load_recipe("tiny", ["model.device=cuda", "train.prompts_per_iter=4"])
    data = build_task(cfg)
    model, _ = train_baseline(cfg, data, tmp_path / "sft")
    assert next(model.parameters()).device.type == "cuda"
    base, _ = load_checkpoint(tmp_path / "sft")  # written from GPU weights, read on the CPU
    assert next(base.parameters()).device.type == "cpu"
    learner = Learner(cfg, tmp_path / "sft")
    assert all(p.device.type == "cuda" for p in learner.params)
    before = [p.detach().clone() for p in learner.params]
    batch = learner.sample(data, 0)
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 2  # every group has signal
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    stats = learner.update(batch)
    assert stats["rows"] > 0 and any(not torch.equal(a, p) for a, p in zip(before, learner.params))
    adapter = learner.save_adapter(tmp_path / "adapter")
    cpu_policy = load_adapter(load_checkpoint(tmp_path / "sft")[0], adapter)
    gpu_logits = learner.model(ids, mask)
    torch.testing.assert_close(cpu_policy(ids, mask), gpu_logits, atol=1e-4, rtol=1e-4)
