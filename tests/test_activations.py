"""Activation checkpointing (miles_core/models/activations.py): the same gradients, each layer
recomputed in backward, nothing changed under no_grad or in the adapter's keys. Families: the
tiny model, the bidirectional Llama wrapper, and transformers' own DiffusionGemma class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_core.models.__main__ import init
from miles_core.models.activations import checkpoint_layers, layer_stacks
from miles_core.models.base import load_checkpoint
from miles_core.models.lora import add_lora, adapter_tensors


def lora_model(family: str, tmp: Path):
    base, _ = load_checkpoint(init(family, str(tmp / family), seed=3))
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    model = add_lora(base, r=4, alpha=8, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # B = 0 at init would make every gradient but B's zero
    return model


def grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp = model(ids, torch.ones_like(ids, dtype=torch.bool)).float().log_softmax(-1)  # [B, T, V]
    logp.gather(-1, ids[..., None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["tiny", "bidir_llama"])
def test_checkpointed_layers_give_the_same_gradients_and_are_recomputed_in_backward(family: str, tmp_path: Path) -> None:
    model = lora_model(family, tmp_path)
    ids = torch.randint(4, 60, (3, 12))
    plain = grads(model, ids)
    keys = list(adapter_tensors(model))
    stacks = layer_stacks(model)
    n_layers = sum(len(s) for s in stacks)
    assert n_layers >= 1 and checkpoint_layers(model) == n_layers == checkpoint_layers(model)  # idempotent
    calls = []
    # the recomputation calls the layer's own forward, not the module: count a Linear inside each layer
    inner = [next(m for m in layer.modules() if isinstance(m, torch.nn.Linear)) for s in stacks for layer in s]
    hooks = [m.register_forward_pre_hook(lambda m, a: calls.append(1)) for m in inner]
    again = grads(model, ids)
    assert len(calls) == 2 * n_layers  # forward, then the recomputation in backward
    assert again.keys() == plain.keys()
    for n in plain:
        torch.testing.assert_close(again[n], plain[n], rtol=1e-5, atol=1e-6)
    calls.clear()
    with torch.no_grad():  # sampling: one plain forward per layer
        model(ids, torch.ones_like(ids, dtype=torch.bool))
    assert len(calls) == n_layers
    for h in hooks:
        h.remove()
    assert list(adapter_tensors(model)) == keys  # what is published does not change


def test_layer_stacks_are_found_by_shape_in_diffusion_gemma(tmp_path: Path) -> None:
    base, _ = load_checkpoint(init("diffusion_gemma", str(tmp_path / "dg"), seed=1))
    stacks = layer_stacks(base)
    assert stacks and all(len({type(c) for c in s}) == 1 for s in stacks)
    assert any("Decoder" in type(s[0]).__name__ or "Layer" in type(s[0]).__name__ for s in stacks)


def test_a_learner_with_grad_checkpointing_makes_the_same_update(tmp_path: Path) -> None:
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.learner.policy import Learner

    base = init("tiny", str(tmp_path / "base"), seed=5)
    out = {}
    for on in (False, True):
        cfg = load_recipe("tiny", ["train.prompts_per_iter=4", "train.group_size=4", f"update.grad_checkpointing={str(on).lower()}"])
        learner = Learner(cfg, base)
        with torch.no_grad():
            for n, p in learner.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
        batch = learner.sample(build_task(cfg), 0)
        batch.advantage = torch.linspace(-1, 1, len(batch))  # every trajectory informative
        stats = learner.update(batch)
        out[on] = ({k: v.clone() for k, v in adapter_tensors(learner.model).items()}, stats["rows"])
    assert out[True][1] == out[False][1] > 0
    for k, v in out[False][0].items():
        torch.testing.assert_close(out[True][0][k], v, rtol=1e-5, atol=1e-6)
